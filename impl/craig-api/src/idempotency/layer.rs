//! The tower [`Layer`](tower::Layer) that puts a route behind §D5.

use std::sync::Arc;

use super::service::Idempotency;
use super::store::Store;
use super::Config;

/// Wrap idempotent routes: `Router::new().route(..).route_layer(IdempotencyLayer::new(cfg, store))`.
#[derive(Clone)]
pub struct IdempotencyLayer {
    cfg: Arc<Config>,
    store: Store,
}

impl IdempotencyLayer {
    pub fn new(cfg: Config, store: Store) -> Self {
        Self { cfg: Arc::new(cfg), store }
    }
}

impl<S> tower::Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.cfg.clone(), self.store.clone())
    }
}
