//! Several broker endpoints (issue 25): a node given a list of AMQP URLs connects to the
//! first that answers and moves on from one that refuses or hangs, on a real RabbitMQ.

use std::time::Duration;

use crate::common::*;

/// `url` with its host and port replaced by 127.0.0.1:`port` (credentials and vhost kept).
fn at_port(url: &str, port: u16) -> String {
    let (scheme_user, rest) = url.split_once('@').expect("the sandbox URL names its user");
    let (_, path) = rest.split_once('/').expect("the sandbox URL names its vhost");
    format!("{scheme_user}@127.0.0.1:{port}/{path}")
}

/// The list names a port that refuses, then one that accepts and never answers, then the
/// broker. The first connect passes both dead ones (the hung one within its bound); the
/// next connect of the process starts at the broker that answered. A publisher and a
/// consumer on the list publish with a confirm and see the message.
#[tokio::test]
async fn a_node_moves_past_a_refusing_and_a_hung_endpoint_to_the_broker() {
    let env = env("endpoints").await;
    env.declare_rules_queue().await;
    let refused = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let hung = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hung_port = hung.local_addr().unwrap().port();
    let tries = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = tries.clone();
    let accepted = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = hung.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            held.push(s);
        }
    });
    let real = env.sandbox.amqp_url();
    let list = format!("{},{},{real}", at_port(real, refused), at_port(real, hung_port));
    let conn = craig_mq::publisher::connect_within(&list, 2, "endpoints-test", Duration::from_secs(3))
        .await
        .expect("the third endpoint answers");
    assert!(conn.status().connected());
    let _ = conn.close(200, "bye".into()).await;
    assert_eq!(tries.load(std::sync::atomic::Ordering::SeqCst), 1, "the hung endpoint was tried once");
    // The process remembers the endpoint that answered: the next connect goes straight
    // there, never to the hung endpoint again.
    let conn = craig_mq::publisher::connect_within(&list, 2, "endpoints-test", Duration::from_secs(3)).await.expect("straight to the broker");
    let _ = conn.close(200, "bye".into()).await;
    assert_eq!(tries.load(std::sync::atomic::Ordering::SeqCst), 1, "the second connect went straight to the broker");
    let publisher = craig_mq::Publisher::connect(&list, fast_publisher()).await.expect("publisher on the list");
    let sent = envelope();
    publisher.publish(&sent).await.expect("confirmed");
    publisher.close().await;
    assert_eq!(env.take_all().await, [sent.id.to_string()]);
    accepted.abort();
    env.finish().await;
}

/// Every endpoint dead: the error is the last endpoint's, and nothing hangs past the bounds.
#[tokio::test]
async fn a_list_of_dead_endpoints_fails_with_the_last_error() {
    let dead: Vec<u16> = (0..2).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()).collect();
    let list = dead.iter().map(|p| format!("amqp://guest:guest@127.0.0.1:{p}/%2f")).collect::<Vec<_>>().join(",");
    let err = craig_mq::publisher::connect_within(&list, 2, "endpoints-test", Duration::from_millis(500)).await.unwrap_err();
    assert!(err.to_string().contains("refused") || err.to_string().contains("Connection refused"), "{err}");
}
