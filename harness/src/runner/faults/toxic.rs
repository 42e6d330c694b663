//! `toxic`: a Toxiproxy toxic on one replica's link to the database or the broker, for the
//! hold (`duration_ms`). Evidence: payload the toxic acted on (issue 22.9).

use super::{Cx, Room, not_supported};
use crate::backend::BackendKind;
use crate::proxy::Toxic;
use crate::scenario::{Fault, FaultTarget};

pub(super) struct ToxicRoom;

/// The link faults need a Toxiproxy in front of every replica's connections: the harness's
/// own (local, external) or the backend's container (containers). Every backend has one.
pub(super) fn link_supported(_: BackendKind) -> Result<(), &'static str> {
    Ok(())
}

/// The proxy of a link target (`<replica>-><to>`).
pub(super) fn proxy_of(f: &Fault, target: &FaultTarget) -> anyhow::Result<String> {
    match target {
        FaultTarget::Link { replica, to } => Ok(format!("{replica}->{to}")),
        _ => Err(not_supported(f)),
    }
}

impl Room for ToxicRoom {
    /// The proxy and the toxic's name.
    type Applied = (String, String);

    fn supported(backend: BackendKind, _: &FaultTarget) -> Result<(), &'static str> {
        link_supported(backend)
    }

    async fn apply(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<(String, String)> {
        let proxy = proxy_of(f, target)?;
        let spec = f.toxic.clone().expect("validated");
        let toxic = Toxic { name: format!("fault-{}", cx.index), stream: spec.stream, toxicity: spec.toxicity, kind: spec.kind };
        cx.toxi.add_toxic(&proxy, &toxic).await?;
        Ok((proxy, toxic.name))
    }

    async fn heal(cx: &Cx, _: &Fault, _: &FaultTarget, (proxy, name): (String, String)) -> anyhow::Result<()> {
        // Evidence before removal: what the toxic acted on while it was in place.
        // Bytes it took in: a toxic on idle connections acted on nothing. A Toxiproxy
        // without these counters gives no evidence either.
        let affected = cx.toxi.proxy(&proxy).await?.affected;
        cx.evidence(
            // Issue 22.9: payload, not heartbeats (an idle AMQP link still beats).
            affected
                .get(&name)
                .filter(|a| a.payload_bytes > 0)
                .map(|a| format!("{} bytes ({} of payload) over {} connections", a.bytes, a.payload_bytes, a.connections)),
        );
        cx.toxi.remove_toxic(&proxy, &name).await?;
        Ok(())
    }
}
