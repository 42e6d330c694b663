//! `down`: one replica's link disabled for the hold (`duration_ms`): live connections cut,
//! new ones refused. Evidence: the live connections it cut.

use super::toxic::{link_supported, proxy_of};
use super::{Cx, Room};
use crate::backend::BackendKind;
use crate::scenario::{Fault, FaultTarget};

pub(super) struct Down;

impl Room for Down {
    /// The proxy.
    type Applied = String;

    fn supported(backend: BackendKind, _: &FaultTarget) -> Result<(), &'static str> {
        link_supported(backend)
    }

    async fn apply(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<String> {
        let proxy = proxy_of(f, target)?;
        let before = cx.toxi.proxy(&proxy).await?.cut_connections;
        let after = cx.toxi.set_enabled(&proxy, false).await?.cut_connections;
        // Evidence: live connections it cut (new ones are refused while it is down,
        // which the proxy cannot count).
        cx.evidence(match (before, after) {
            (Some(b), Some(a)) if a > b => Some(format!("{} live connections cut", a - b)),
            _ => None,
        });
        Ok(proxy)
    }

    async fn heal(cx: &Cx, _: &Fault, _: &FaultTarget, proxy: String) -> anyhow::Result<()> {
        cx.toxi.set_enabled(&proxy, true).await?;
        Ok(())
    }
}
