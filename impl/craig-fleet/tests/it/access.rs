//! Least privilege on the broker (ADR-022 #1202, `craig_fleet::access`) on a real RabbitMQ:
//! every service logs in with its own account. What the ADR forbids is refused with
//! ACCESS_REFUSED, what each service's own work needs is allowed (the app-path test runs
//! rules and security nodes on these accounts end to end), and the residual the ADR states
//! — a writer can publish a forged `dlq.*` record — is still there.

use crate::common::*;
use craig_fleet::Service;
use craig_fleet::service::ALL;
use craig_mq::dlq::CAPTURE_QUEUE;
use craig_mq::topology::{DLQ_QUEUE, DLX_EXCHANGE, EVENTS_EXCHANGE, QueueType};
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, QueuePurgeOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};

async fn login(url: &str) -> Connection {
    craig_mq::publisher::connect(url, 5, "access-test").await.expect("the account logs in")
}

async fn channel(conn: &Connection) -> Channel {
    conn.create_channel().await.expect("channel")
}

#[track_caller]
fn refused<T: std::fmt::Debug>(what: &str, r: Result<T, lapin::Error>) {
    match r {
        Err(e) if e.to_string().contains("ACCESS_REFUSED") => {}
        other => panic!("{what}: expected ACCESS_REFUSED, got {other:?}"),
    }
}

/// Publish with confirms; the broker's answer (an access refusal closes the channel).
async fn publish(conn: &Connection, exchange: &str, key: &str) -> Result<lapin::Confirmation, lapin::Error> {
    let ch = channel(conn).await;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    ch.basic_publish(exchange.into(), key.into(), BasicPublishOptions::default(), b"{}", BasicProperties::default()).await?.await
}

#[tokio::test]
async fn each_service_account_is_refused_what_the_adr_forbids_and_keeps_what_it_needs() {
    least_privilege_holds("least-privilege", QueueType::Classic).await;
}

/// The same rules on quorum queues (issue 25): the queue type changes no permission.
#[tokio::test]
async fn least_privilege_holds_on_quorum_queues() {
    least_privilege_holds("least-privilege-quorum", QueueType::Quorum).await;
}

async fn least_privilege_holds(label: &str, queue_type: QueueType) {
    let mut fleet = Fleet::typed(label, &[Service::Cases], &Default::default(), queue_type).await;
    fleet.least_privilege().await;
    // Every consumer queue exists (as after the deploy step), so a refusal is about access.
    for other in ALL.into_iter().filter(|o| !o.queue_bindings().is_empty()) {
        fleet.declare_queue(&craig_mq::topology::consumer_queue(other.name()), other.queue_bindings()[0]).await;
    }
    for s in ALL {
        let conn = login(fleet.amqp_url(s)).await;
        // The exchanges are operator-owned: no service redeclares or deletes one ...
        for x in [EVENTS_EXCHANGE, DLX_EXCHANGE] {
            let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
            let r = channel(&conn).await.exchange_declare(x.into(), ExchangeKind::Topic, durable, FieldTable::default()).await;
            refused(&format!("{s} redeclaring {x}"), r);
            let r = channel(&conn).await.exchange_delete(x.into(), ExchangeDeleteOptions::default()).await;
            refused(&format!("{s} deleting {x}"), r);
        }
        // ... but every node can check that they exist (a passive declare needs nothing).
        craig_mq::topology::require_exchanges(&channel(&conn).await).await.expect("passive declares are allowed");
        // Only security consumes (and so acks or suppresses) the DLQ, or deletes it.
        let r = channel(&conn).await.basic_consume(DLQ_QUEUE.into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()).await;
        if s == Service::Security {
            r.expect("security consumes its DLQ");
        } else {
            refused(&format!("{s} consuming {DLQ_QUEUE}"), r);
            refused(&format!("{s} deleting {DLQ_QUEUE}"), channel(&conn).await.queue_delete(DLQ_QUEUE.into(), QueueDeleteOptions::default()).await);
            refused(&format!("{s} purging {DLQ_QUEUE}"), channel(&conn).await.queue_purge(DLQ_QUEUE.into(), QueuePurgeOptions::default()).await);
            refused(
                &format!("{s} unbinding {DLQ_QUEUE}"),
                channel(&conn).await.queue_unbind(DLQ_QUEUE.into(), DLX_EXCHANGE.into(), "dlq.#".into(), FieldTable::default()).await,
            );
            // Nor may it reach the DLQ through the default exchange.
            refused(&format!("{s} publishing to the default exchange"), publish(&conn, "", DLQ_QUEUE).await);
        }
        // No service reads another's consumer queue.
        for other in ALL.into_iter().filter(|o| *o != s && !o.queue_bindings().is_empty()) {
            let q = craig_mq::topology::consumer_queue(other.name());
            let r = channel(&conn).await.basic_get(q.as_str().into(), BasicGetOptions::default()).await;
            refused(&format!("{s} reading {q}"), r);
        }
        let _ = conn.close(200, "bye".into()).await;
    }

    // cases produces only: it cannot write to craig.dlx at all.
    let cases = login(fleet.amqp_url(Service::Cases)).await;
    refused("cases publishing to craig.dlx", publish(&cases, DLX_EXCHANGE, "dlq.craig-rules.events").await);
    publish(&cases, EVENTS_EXCHANGE, "case.referral_created").await.expect("cases publishes its events");
    let _ = cases.close(200, "bye".into()).await;

    // security's capture path: its own capture queue through the default exchange.
    let security = login(fleet.amqp_url(Service::Security)).await;
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    channel(&security).await.queue_declare(CAPTURE_QUEUE.into(), durable, queue_type.plain_args()).await.expect("security declares its capture queue");
    let c = publish(&security, "", CAPTURE_QUEUE).await.expect("security captures through the default exchange");
    assert!(c.is_ack(), "{c:?}");
    let _ = security.close(200, "bye".into()).await;

    // The residual the ADR states: rules (write on craig.dlx for its queue's DLX) can still
    // publish a forged dlq.* record, and it is routed to the DLQ.
    let rules = login(fleet.amqp_url(Service::Rules)).await;
    let c = publish(&rules, DLX_EXCHANGE, "dlq.forged").await.expect("a forged dlq.* publish is not refused");
    assert!(c.is_ack(), "{c:?}");
    let _ = rules.close(200, "bye".into()).await;
    assert_eq!(fleet.depth(DLQ_QUEUE).await, 1, "the forged record reached the DLQ: the residual of #1202");
    fleet.finish().await;
}
