//! A small async client for Toxiproxy's HTTP API. The harness drives faults only through
//! it, so the in-process [`FaultProxy`](super::FaultProxy) and a real Toxiproxy server are
//! interchangeable.

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::json;

use super::{ProxyInfo, Toxic};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("toxiproxy at {base}: {source}")]
    Http { base: String, source: reqwest::Error },
    #[error("toxiproxy answered {status} to {what}: {body}")]
    Status { what: String, status: u16, body: String },
}

#[derive(Clone)]
pub struct ToxiproxyClient {
    base: String,
    http: reqwest::Client,
}

impl ToxiproxyClient {
    /// `base` like `http://127.0.0.1:8474`.
    pub fn new(base: impl Into<String>) -> Self {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().expect("reqwest client");
        Self { base: base.into().trim_end_matches('/').to_owned(), http }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    async fn call<T: DeserializeOwned>(&self, req: reqwest::RequestBuilder, what: String) -> Result<Option<T>, ClientError> {
        let resp = req.send().await.map_err(|source| ClientError::Http { base: self.base.clone(), source })?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            return Err(ClientError::Status { what, status: status.as_u16(), body });
        }
        if status == reqwest::StatusCode::NO_CONTENT {
            return Ok(None);
        }
        let text = resp.text().await.map_err(|source| ClientError::Http { base: self.base.clone(), source })?;
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| ClientError::Status { what, status: status.as_u16(), body: format!("{e}: {text}") })
    }

    pub async fn version(&self) -> Result<String, ClientError> {
        let resp = self
            .http
            .get(format!("{}/version", self.base))
            .send()
            .await
            .map_err(|source| ClientError::Http { base: self.base.clone(), source })?;
        resp.text().await.map_err(|source| ClientError::Http { base: self.base.clone(), source })
    }

    /// Create a proxy; `listen` may be `127.0.0.1:0` against our proxy (the reply has the port).
    pub async fn create_proxy(&self, name: &str, listen: &str, upstream: &str) -> Result<ProxyInfo, ClientError> {
        let req = self.http.post(format!("{}/proxies", self.base)).json(&json!({
            "name": name, "listen": listen, "upstream": upstream, "enabled": true
        }));
        Ok(self.call(req, format!("create proxy {name}")).await?.expect("proxy body"))
    }

    pub async fn proxy(&self, name: &str) -> Result<ProxyInfo, ClientError> {
        let req = self.http.get(format!("{}/proxies/{name}", self.base));
        Ok(self.call(req, format!("get proxy {name}")).await?.expect("proxy body"))
    }

    pub async fn set_enabled(&self, name: &str, enabled: bool) -> Result<ProxyInfo, ClientError> {
        let req = self.http.post(format!("{}/proxies/{name}", self.base)).json(&json!({ "enabled": enabled }));
        Ok(self.call(req, format!("set {name} enabled={enabled}")).await?.expect("proxy body"))
    }

    /// Toxiproxy's upstream update: new connections go to `upstream`; an enabled proxy
    /// restarts, its live connections cut (issue 26: a failover moves the database address).
    pub async fn set_upstream(&self, name: &str, upstream: &str) -> Result<ProxyInfo, ClientError> {
        let req = self.http.post(format!("{}/proxies/{name}", self.base)).json(&json!({ "upstream": upstream }));
        Ok(self.call(req, format!("set {name} upstream={upstream}")).await?.expect("proxy body"))
    }

    pub async fn delete_proxy(&self, name: &str) -> Result<(), ClientError> {
        let req = self.http.delete(format!("{}/proxies/{name}", self.base));
        self.call::<serde_json::Value>(req, format!("delete proxy {name}")).await.map(|_| ())
    }

    pub async fn add_toxic(&self, proxy: &str, toxic: &Toxic) -> Result<Toxic, ClientError> {
        let req = self.http.post(format!("{}/proxies/{proxy}/toxics", self.base)).json(toxic);
        Ok(self.call(req, format!("add toxic {} to {proxy}", toxic.name)).await?.expect("toxic body"))
    }

    pub async fn remove_toxic(&self, proxy: &str, name: &str) -> Result<(), ClientError> {
        let req = self.http.delete(format!("{}/proxies/{proxy}/toxics/{name}", self.base));
        self.call::<serde_json::Value>(req, format!("remove toxic {name} from {proxy}")).await.map(|_| ())
    }

    pub async fn reset(&self) -> Result<(), ClientError> {
        let req = self.http.post(format!("{}/reset", self.base));
        self.call::<serde_json::Value>(req, "reset".into()).await.map(|_| ())
    }
}
