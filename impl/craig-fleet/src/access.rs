//! Least privilege on the broker — ADR-022 #1202 (ADR-003 Amendment #1202): one RabbitMQ
//! account per service instead of the shared over-privileged credential.
//!
//! RabbitMQ checks three regexes per vhost (configure, write, read) against the resource a
//! method touches: `queue.declare` needs configure on the queue (and, with DLX arguments,
//! write on the DLX and read on the queue); `queue.bind` write on the queue and read on the
//! exchange; `basic.publish` write on the exchange (the default exchange is `amq.default`);
//! `basic.consume`/`basic.get` read on the queue. Passive declares need nothing.
//!
//! What the accounts below guarantee:
//! - only `craig-security` can consume (and so ack or suppress) `craig-security.dlq`;
//! - no service can delete or redeclare `craig.dlx` or `craig.events`: the exchanges are
//!   operator-owned, declared by the deploy step (`craig-node topology`) with the
//!   operator's credential, and every service has `configure` on its own queues only;
//! - a producer-only service (cases) cannot write to `craig.dlx` at all.
//!
//! The residual the ADR states: every service that owns a consumer queue has `write` on
//! `craig.dlx` (its queue's DLX arguments require it, and the app path publishes there), so
//! it can still publish a forged `dlq.*` record. Topic permissions are the future hardening
//! (ADR-003 Amendment #1202); a forged record with an existing token lands in quarantine.
//! Beyond the ADR's list: security captures malformed dead letters through the default
//! exchange, so it has write on `amq.default`, which reaches any queue of the vhost (routing
//! the capture through `craig.dlx` under a non-`dlq.` key would close that).

use crate::service::{ALL, Service};
use craig_mq::dlq::CAPTURE_QUEUE;
use craig_mq::topology::{DLQ_QUEUE, DLX_EXCHANGE, EVENTS_EXCHANGE, consumer_queue};

/// One account's permissions on the fleet's vhost: anchored regexes, as `rabbitmqctl
/// set_permissions` and the management API take them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permissions {
    pub configure: String,
    pub write: String,
    pub read: String,
}

/// The account name of `service` (`craig-<service>`).
pub fn user(service: Service) -> String {
    format!("craig-{}", service.name())
}

/// The queues `service` owns: its consumer queue (if it has bindings) and, for security,
/// the DLQ and its capture queue.
pub fn owned_queues(service: Service) -> Vec<String> {
    let mut q = Vec::new();
    if !service.queue_bindings().is_empty() {
        q.push(consumer_queue(service.name()));
    }
    if service == Service::Security {
        q.push(DLQ_QUEUE.to_owned());
        q.push(CAPTURE_QUEUE.to_owned());
    }
    q
}

/// `^(a|b|…)$` with every name escaped; `^$` (nothing) for no names.
fn anchored(names: &[String]) -> String {
    if names.is_empty() {
        return "^$".to_owned();
    }
    let escaped: Vec<String> = names.iter().map(|n| n.replace('.', "\\.")).collect();
    format!("^({})$", escaped.join("|"))
}

/// The least privilege `service` runs with (#1202).
pub fn permissions(service: Service) -> Permissions {
    let own = owned_queues(service);
    let consumes_a_queue = !own.is_empty();
    // configure: its own queues only; never an exchange.
    let configure = anchored(&own);
    // write: craig.events (every service produces); craig.dlx where it owns a queue with
    // DLX arguments or surfaces app-path dead letters; its own queues (bindings);
    // security also captures malformed dead letters through the default exchange.
    let mut write = vec![EVENTS_EXCHANGE.to_owned()];
    if consumes_a_queue {
        write.push(DLX_EXCHANGE.to_owned());
        write.extend(own.iter().cloned());
    }
    if service == Service::Security {
        write.push("amq.default".to_owned());
    }
    // read: its own queues (consume, DLX declare) and the exchanges it binds them on.
    let mut read = Vec::new();
    if consumes_a_queue {
        read.push(EVENTS_EXCHANGE.to_owned());
        read.extend(own.iter().cloned());
    }
    if service == Service::Security {
        read.push(DLX_EXCHANGE.to_owned());
    }
    Permissions { configure, write: anchored(&write), read: anchored(&read) }
}

/// Every service's account and permissions, for a deploy script or a harness.
pub fn accounts() -> Vec<(Service, String, Permissions)> {
    ALL.into_iter().map(|s| (s, user(s), permissions(s))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(re: &str, name: &str) -> bool {
        // The regexes are `^$` or `^(a|b)$` of literal names: match by hand.
        if re == "^$" {
            return name.is_empty();
        }
        let inner = re.strip_prefix("^(").and_then(|r| r.strip_suffix(")$")).expect("anchored alternation");
        inner.split('|').any(|alt| alt.replace("\\.", ".") == name)
    }

    #[test]
    fn only_security_may_read_the_dlq_and_nobody_configures_an_exchange() {
        for (svc, _, p) in accounts() {
            assert_eq!(matches(&p.read, DLQ_QUEUE), svc == Service::Security, "{svc}: read on the DLQ");
            for x in [EVENTS_EXCHANGE, DLX_EXCHANGE] {
                assert!(!matches(&p.configure, x), "{svc} may configure {x}");
            }
        }
    }

    #[test]
    fn each_service_has_what_its_own_work_needs_and_no_more() {
        let p = permissions(Service::Cases);
        assert_eq!(p, Permissions { configure: "^$".into(), write: "^(craig\\.events)$".into(), read: "^$".into() });
        let p = permissions(Service::Rules);
        assert_eq!(p.configure, "^(craig-rules\\.events)$");
        assert!(matches(&p.write, "craig.dlx"), "its queue's DLX arguments and the app path need write on craig.dlx");
        assert!(matches(&p.read, "craig.events") && matches(&p.read, "craig-rules.events"));
        assert!(!matches(&p.read, "craig-security.events") && !matches(&p.write, "amq.default"));
        let p = permissions(Service::Security);
        for q in ["craig-security.events", "craig-security.dlq", "craig-security.dlq.capture"] {
            assert!(matches(&p.configure, q) && matches(&p.read, q), "{q}");
        }
        assert_eq!(user(Service::Financial), "craig-financial");
    }
}
