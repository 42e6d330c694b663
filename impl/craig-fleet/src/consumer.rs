//! One shape for every inbox-backed consumer of the fleet (rules, financial): the §D2 inbox
//! around the handler, the handler's failure read as permanent (dead-lettered, §D3 broker
//! path) or transient (requeued), and the inbox retry cap that surfaces a transient failure
//! on the app path with this consumer's own queue (§D3, #1196).
//!
//! Under compat `pre-d2` the inbox is bypassed (and with it the app path: no inbox row, no
//! token to derive).

use std::future::Future;

use craig_mq::inbox::{RetryCap, Surface};
use craig_mq::subscriber::HandlerError;
use craig_mq::{EventEnvelope, InboxError, handle_idempotently};
use sqlx::PgPool;

/// Who consumes, from which queue, and how.
pub struct Consumer {
    pub queue: String,
    pub use_inbox: bool,
    /// `CRAIG_REPLICA`: recorded with each side effect.
    pub replica: Option<String>,
    /// The inbox retry cap and the app dead-letter path (§D3, #1196); `None` without an
    /// inbox (compat `pre-d2`: nothing to derive a token from, so it requeues as before).
    pub app_path: Option<(RetryCap, Surface)>,
}

/// A handler's failure.
#[derive(Debug, thiserror::Error)]
pub enum ConsumeError {
    /// Read by [`crate::db_error::handler_error`]: refused data is permanent, the rest
    /// transient.
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    /// The envelope cannot be handled, ever (a missing or malformed payload field):
    /// permanent.
    #[error("payload: {0}")]
    Payload(String),
}

impl From<ConsumeError> for HandlerError {
    fn from(e: ConsumeError) -> Self {
        match e {
            ConsumeError::Db(e) => crate::db_error::handler_error(e),
            ConsumeError::Payload(why) => HandlerError::Permanent(why),
        }
    }
}

impl Consumer {
    /// Handle one delivery behind the inbox (or straight, under `pre-d2`).
    ///
    /// A transient failure of the same envelope for the `cap`-th time surfaces it to
    /// `craig.dlx` (`surface_to_dlx` with this consumer's queue, #1196) and returns `Ok`, so
    /// the subscriber acks it only once the dead letter is confirmed on the broker; a surface
    /// that fails leaves the failure transient (requeued, nothing lost).
    pub async fn consume<F, Fut>(&self, pool: &PgPool, envelope: EventEnvelope, handler: F) -> Result<(), HandlerError>
    where
        F: FnOnce(EventEnvelope) -> Fut,
        Fut: Future<Output = Result<(), ConsumeError>>,
    {
        if !self.use_inbox {
            return handler(envelope).await.map_err(HandlerError::from);
        }
        let id = envelope.id;
        let result = match handle_idempotently(pool, &envelope, &self.queue, handler).await {
            Ok(_) => Ok(()),
            Err(InboxError::Db(e)) => Err(crate::db_error::handler_error(e)),
            Err(InboxError::Handler { source, .. }) => Err(HandlerError::from(source)),
        };
        let Some((cap, surface)) = &self.app_path else { return result };
        match result {
            Err(HandlerError::Transient(why)) if cap.failed(id) => {
                let reason = format!("retry cap of {} reached: {why}", cap.cap());
                match surface.surface_to_dlx(pool, &envelope, &self.queue, &reason).await {
                    Ok(_) => {
                        cap.settled(id);
                        Ok(())
                    }
                    Err(e) => Err(HandlerError::Transient(format!("{why}; surfacing to craig.dlx failed: {e}"))),
                }
            }
            Err(e) => Err(e),
            Ok(()) => {
                cap.settled(id);
                Ok(())
            }
        }
    }
}
