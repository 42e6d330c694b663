//! Toxiproxy's HTTP API over [`FaultProxy`](super::FaultProxy):
//! `GET/POST /proxies`, `GET/POST/DELETE /proxies/{proxy}`,
//! `GET/POST /proxies/{proxy}/toxics`, `GET/POST/DELETE /proxies/{proxy}/toxics/{toxic}`,
//! `POST /reset`, `GET /version`. Errors are `{"error": "...", "status": N}` as Toxiproxy's.

use std::net::SocketAddr;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

use super::{FaultProxy, ProxyError, Toxic};

/// The Toxiproxy version this API follows.
pub const VERSION: &str = "2.12.0";

impl IntoResponse for ProxyError {
    fn into_response(self) -> Response {
        let status = match self {
            ProxyError::Exists(_) | ProxyError::ToxicExists(_) => StatusCode::CONFLICT,
            ProxyError::NoProxy(_) | ProxyError::NoToxic(_) => StatusCode::NOT_FOUND,
            ProxyError::Bad(_) | ProxyError::Listen { .. } => StatusCode::BAD_REQUEST,
        };
        (status, Json(json!({ "error": self.to_string(), "status": status.as_u16() }))).into_response()
    }
}

pub fn router(proxy: FaultProxy) -> Router {
    Router::new()
        .route("/version", get(|| async { VERSION }))
        .route("/reset", post(reset))
        .route("/proxies", get(list).post(create))
        .route("/proxies/{proxy}", get(show).post(update).delete(delete))
        .route("/proxies/{proxy}/toxics", get(toxics).post(add_toxic))
        .route("/proxies/{proxy}/toxics/{toxic}", get(show_toxic).post(update_toxic).delete(remove_toxic))
        .with_state(proxy)
}

/// Serve the API on `addr` (port 0 picks one); returns the bound address.
pub async fn serve(proxy: FaultProxy, addr: SocketAddr) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router(proxy)).await;
    });
    Ok((bound, task))
}

type ApiResult<T> = Result<T, ProxyError>;

fn bad(e: impl std::fmt::Display) -> ProxyError {
    ProxyError::Bad(e.to_string())
}

async fn reset(State(p): State<FaultProxy>) -> ApiResult<StatusCode> {
    p.reset().await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn list(State(p): State<FaultProxy>) -> Json<serde_json::Value> {
    let map: serde_json::Map<String, serde_json::Value> =
        p.list().into_iter().map(|i| (i.name.clone(), serde_json::to_value(i).expect("info serializes"))).collect();
    Json(serde_json::Value::Object(map))
}

#[derive(Deserialize)]
struct NewProxy {
    name: String,
    #[serde(default = "any_port")]
    listen: String,
    upstream: String,
    #[serde(default = "yes")]
    enabled: bool,
}

fn any_port() -> String {
    "127.0.0.1:0".into()
}

fn yes() -> bool {
    true
}

async fn create(State(p): State<FaultProxy>, body: axum::body::Bytes) -> ApiResult<(StatusCode, Json<super::ProxyInfo>)> {
    let req: NewProxy = serde_json::from_slice(&body).map_err(bad)?;
    let info = p.create(&req.name, &req.listen, &req.upstream, req.enabled).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

async fn show(State(p): State<FaultProxy>, Path(name): Path<String>) -> ApiResult<Json<super::ProxyInfo>> {
    Ok(Json(p.get(&name)?))
}

#[derive(Deserialize)]
struct ProxyUpdate {
    enabled: Option<bool>,
    upstream: Option<String>,
}

async fn update(State(p): State<FaultProxy>, Path(name): Path<String>, body: axum::body::Bytes) -> ApiResult<Json<super::ProxyInfo>> {
    let req: ProxyUpdate = serde_json::from_slice(&body).map_err(bad)?;
    if let Some(upstream) = &req.upstream {
        p.set_upstream(&name, upstream).await?;
    }
    match req.enabled {
        Some(e) => Ok(Json(p.set_enabled(&name, e).await?)),
        None => Ok(Json(p.get(&name)?)),
    }
}

async fn delete(State(p): State<FaultProxy>, Path(name): Path<String>) -> ApiResult<StatusCode> {
    p.delete(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn toxics(State(p): State<FaultProxy>, Path(name): Path<String>) -> ApiResult<Json<Vec<Toxic>>> {
    Ok(Json(p.get(&name)?.toxics))
}

async fn add_toxic(State(p): State<FaultProxy>, Path(name): Path<String>, body: axum::body::Bytes) -> ApiResult<Json<Toxic>> {
    let toxic: Toxic = serde_json::from_slice(&body).map_err(bad)?;
    Ok(Json(p.add_toxic(&name, toxic)?))
}

async fn show_toxic(State(p): State<FaultProxy>, Path((name, toxic)): Path<(String, String)>) -> ApiResult<Json<Toxic>> {
    p.get(&name)?.toxics.into_iter().find(|t| t.name == toxic).map(Json).ok_or(ProxyError::NoToxic(toxic))
}

#[derive(Deserialize)]
struct ToxicUpdate {
    toxicity: Option<f32>,
    attributes: Option<serde_json::Value>,
}

async fn update_toxic(
    State(p): State<FaultProxy>,
    Path((name, toxic)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> ApiResult<Json<Toxic>> {
    let req: ToxicUpdate = serde_json::from_slice(&body).map_err(bad)?;
    Ok(Json(p.update_toxic(&name, &toxic, req.toxicity, req.attributes)?))
}

async fn remove_toxic(State(p): State<FaultProxy>, Path((name, toxic)): Path<(String, String)>) -> ApiResult<StatusCode> {
    p.remove_toxic(&name, &toxic)?;
    Ok(StatusCode::NO_CONTENT)
}
