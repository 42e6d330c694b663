//! Issue 21 (Hardening II) on real `craig-node` processes: hostile request input, settings
//! a node must honour, secrets it must not print, and CONTRACT series present from start-up.

use std::time::Duration;

use crate::common::*;
use craig_fleet::Service;
use serde_json::{Value, json};

fn activate_url(base: &str) -> String {
    format!("{base}/v1/cases/placements/{}/activate", uuid::Uuid::now_v7())
}

/// Issue 21.3, measured: a `start` chrono can hold but whose next month it cannot
/// (`+262142-12-01`) dropped the connection (a panic in `perdiem_period`), and one
/// PostgreSQL refuses (`-5000-01-15`) was answered 503 "database unavailable". Both are
/// the client's error: 400 with the reason, and the key is not left `processing`.
#[tokio::test]
async fn activation_dates_out_of_range_are_a_400_with_the_reason() {
    let fleet = Fleet::new("hardening_dates", &[Service::Cases]).await;
    let cases = fleet.start(Service::Cases, &[], &[]).await;
    let db = fleet.pool(Service::Cases).await;
    let http = reqwest::Client::new();
    for start in ["+262142-12-01", "-5000-01-15", "0000-01-01", "+10000-01-01"] {
        let key = uuid::Uuid::now_v7().to_string();
        let send = || {
            http.post(activate_url(&cases.base))
                .header("idempotency-key", &key)
                .bearer_auth(token("craig-cases", ""))
                .json(&json!({ "care_level": "standard", "start": start }))
                .send()
        };
        let r = send().await.unwrap_or_else(|e| panic!("start {start}: no answer: {e}"));
        assert_eq!(r.status(), 400, "start {start}");
        let body: Value = r.json().await.unwrap();
        assert!(body.to_string().contains("start"), "start {start}: the reason names the field: {body}");
        let again = send().await.unwrap_or_else(|e| panic!("start {start}: no answer to the retry: {e}"));
        assert_ne!(again.status(), 409, "start {start}: the claim was left processing");
    }
    assert_eq!(count(&db, "SELECT count(*) FROM placements").await, 0);
    assert_eq!(count(&db, "SELECT count(*) FROM idempotency_responses WHERE status = 'processing'").await, 0);
    // The edges that are accepted still are.
    for start in ["0001-01-01", "9999-12-31"] {
        let r = http
            .post(activate_url(&cases.base))
            .header("idempotency-key", uuid::Uuid::now_v7().to_string())
            .bearer_auth(token("craig-cases", ""))
            .json(&json!({ "care_level": "standard", "start": start }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "start {start}: {}", r.text().await.unwrap());
    }
    assert_eq!(cases.stop().await.code(), Some(0));
    db.close().await;
    fleet.finish().await;
}

/// Issue 21.6, measured: with `CRAIG_IDEMPOTENCY_TTL_HOURS=1` a new `idempotency_responses`
/// row lived 24 h (the claim hard-coded `interval '24 hours'`). A row's life is the setting,
/// for a new key and for a re-claimed one.
#[tokio::test]
async fn the_idempotency_ttl_setting_decides_a_rows_life() {
    let fleet = Fleet::new("hardening_ttl", &[Service::Cases]).await;
    let cases = fleet.start(Service::Cases, &[("CRAIG_IDEMPOTENCY_TTL_HOURS", "1")], &[]).await;
    let db = fleet.pool(Service::Cases).await;
    let (key, user) = (uuid::Uuid::now_v7().to_string(), token("craig-cases", ""));
    // One POST under the key, then the row's life in seconds.
    let post_and_measure = || async {
        let r = reqwest::Client::new()
            .post(format!("{}/v1/cases/referrals", cases.base))
            .header("idempotency-key", &key)
            .bearer_auth(&user)
            .json(&json!({ "subject": "ttl" }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        sqlx::query_scalar::<_, f64>("SELECT EXTRACT(EPOCH FROM (expires_at - created_at))::float8 FROM idempotency_responses")
            .fetch_one(&db)
            .await
            .unwrap()
    };
    let life = post_and_measure().await;
    assert!((life - 3600.0).abs() < 5.0, "expires_at - created_at = {life} s, CRAIG_IDEMPOTENCY_TTL_HOURS=1 asks 3600 s");
    // A row past its life is re-claimed with the same life.
    sqlx::query("UPDATE idempotency_responses SET expires_at = now() - interval '1 second'").execute(&db).await.unwrap();
    let life = post_and_measure().await;
    assert!((life - 3600.0).abs() < 5.0, "re-claimed: expires_at - created_at = {life} s");
    assert_eq!(count(&db, "SELECT count(*) FROM idempotency_responses WHERE claim_generation = 2").await, 1, "the one row was re-claimed");
    assert_eq!(cases.stop().await.code(), Some(0));
    db.close().await;
    fleet.finish().await;
}

/// Issue 21.8, measured: a fresh node's `/metrics` had no `outbox_publish_lag_seconds` until
/// its first publish. Every CONTRACT series is there from start-up.
#[tokio::test]
async fn every_contract_series_is_present_from_start_up() {
    let fleet = Fleet::new("hardening_series", &[Service::Cases]).await;
    let cases = fleet.start(Service::Cases, &[], &[]).await;
    let text = reqwest::get(format!("{}/metrics", cases.base)).await.unwrap().text().await.unwrap();
    for name in [
        "outbox_depth",
        "outbox_publish_lag_seconds_bucket",
        "outbox_publish_lag_seconds_count",
        "outbox_published_total",
        "outbox_publish_errors_total{kind=\"nacked\"}",
        "inbox_dedup_hits_total",
        "inbox_processed_total",
        "inbox_reprocessed_total",
        "dlq_queue_depth",
        "dlq_outcomes_total{outcome=\"recorded\"}",
        "dlq_outcomes_total{outcome=\"redriven\"}",
        "idempotency_requests_total{outcome=\"miss\"}",
    ] {
        assert!(text.lines().any(|l| l.starts_with(name)), "{name} missing from a fresh node's /metrics:\n{text}");
    }
    assert_eq!(cases.stop().await.code(), Some(0));
    fleet.finish().await;
}

/// Issue 21.7, measured: `DATABASE_URL='postgres://app@127.0.0.1:1/x?password=s3cr3t&sslmode=bogus'
/// craig-node migrate` printed the password. Neither form (userinfo, query parameter), on
/// either URL, reaches a line of either command.
#[tokio::test]
async fn passwords_in_either_form_on_either_url_are_never_printed() {
    let pg_forms = [
        "postgres://app@127.0.0.1:1/x?password=s3cr3tq&sslmode=bogus",
        "postgres://app@127.0.0.1:1/x?sslmode=disable&password=s3cr3tq",
        "postgres://app:s3cr3tu@127.0.0.1:1/x?sslmode=bogus",
        "postgres://app:s3cr3tu@127.0.0.1:1/x",
    ];
    let amqp_forms = ["amqp://guest:s3cr3tu@127.0.0.1:1/%2f", "amqp://guest@127.0.0.1:1/%2f?password=s3cr3tq&heartbeat=bogus"];
    let mut runs: Vec<(Vec<&str>, &str, &str)> = Vec::new();
    for pg in pg_forms {
        runs.push((vec!["migrate", "--service", "cases", "--wait", "1"], pg, "amqp://guest:guest@127.0.0.1:1/%2f"));
        runs.push((vec!["--service", "rules"], pg, "amqp://guest:guest@127.0.0.1:1/%2f"));
    }
    for amqp in amqp_forms {
        runs.push((vec!["--service", "rules"], "postgres://app:s3cr3tu@127.0.0.1:1/x", amqp));
        runs.push((vec!["topology"], "postgres://postgres@127.0.0.1:1/x", amqp));
    }
    // Every run at once: each is bounded by its own attempts, none needs the others.
    let checks = runs.into_iter().map(|(args, db, amqp)| async move {
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_craig-node"))
            .args(&args)
            .args(if args[0] == "--service" { &["--http", "127.0.0.1:0"][..] } else { &[][..] })
            .env("DATABASE_URL", db)
            .env("AMQP_URL", amqp)
            .env("CRAIG_JWT_SECRET", "x")
            .env("CRAIG_AMQP_CONNECT_TIMEOUT_MS", "500")
            .env("RUST_LOG", "debug")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        // A node keeps retrying both servers: give it 3 s of attempts, then stop it.
        if args[0] == "--service" {
            tokio::time::sleep(Duration::from_secs(3)).await;
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id().unwrap() as i32), nix::sys::signal::Signal::SIGTERM);
        }
        let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("{args:?} with {db} / {amqp} did not exit"))
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!text.contains("s3cr3t"), "{args:?} with {db} / {amqp} printed a password:\n{text}");
    });
    futures_util::future::join_all(checks).await;
}

/// The headers a generated request carries: each one valid, hostile or missing.
#[derive(Debug, Clone)]
struct Headers {
    /// `None`: no Idempotency-Key; else its raw bytes (visible ASCII or obs-text).
    key: Option<Vec<u8>>,
    /// `None`: the route's valid token; else the raw Authorization value.
    authorization: Option<Vec<u8>>,
    content_type: Option<Vec<u8>>,
}

/// One generated request to one of the node's routes.
#[derive(Debug, Clone)]
enum Hostile {
    Referral(Value),
    Activate { id: String, body: Value },
    Export { query: String },
    Replay { service: &'static str, query: String },
    /// A raw body that is not JSON at all (bytes as sent).
    RawReferral(Vec<u8>),
}

mod strategies {
    use proptest::prelude::*;
    use serde_json::{Value, json};

    /// Values that have broken parsers: extreme and malformed dates, huge and negative
    /// numbers, long and non-ASCII strings, NUL.
    pub fn nasty_string() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("+262142-12-01".to_owned()),
            Just("-262143-01-01".to_owned()),
            Just("-5000-01-15".to_owned()),
            Just("0000-01-01".to_owned()),
            Just("9999-12-31".to_owned()),
            Just("2026-02-30".to_owned()),
            Just("+10000-01-01T00:00:00Z".to_owned()),
            Just("-4713-11-24T00:00:00Z".to_owned()),
            Just("1970-01-01T00:00:00Z".to_owned()),
            Just("a\u{0}b".to_owned()),
            Just("\u{0}".to_owned()),
            Just(String::new()),
            Just(" ".to_owned()),
            (-300_000i32..300_000, 1u32..13, 1u32..32).prop_map(|(y, m, d)| format!("{y:+07}-{m:02}-{d:02}")),
            (-300_000i32..300_000).prop_map(|y| format!("{y:+07}-06-01T12:00:00Z")),
            "\\PC{0,40}",
            "[a-z\u{e9}\u{1F600}\u{0}]{0,20}",
            (1usize..5000).prop_map(|n| "\u{e9}".repeat(n)),
            (1000usize..3000).prop_map(|n| "x".repeat(n)),
            any::<i64>().prop_map(|n| n.to_string()),
            Just(u64::MAX.to_string()),
            Just("1e400".to_owned()),
            Just(uuid::Uuid::nil().to_string()),
            Just(uuid::Uuid::max().to_string()),
        ]
    }

    pub fn scalar() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            Just(json!(u64::MAX)),
            Just(json!(-1)),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(|f| json!(f)),
            nasty_string().prop_map(Value::String),
            Just(Value::String(uuid::Uuid::now_v7().to_string())),
        ]
    }

    pub fn value() -> impl Strategy<Value = Value> {
        scalar().prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(nasty_string(), inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Dates and timestamps at and past every range a parser or the database has.
    pub fn date() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("+262142-12-01".to_owned()),
            Just("+262143-12-31".to_owned()),
            Just("-262143-01-01".to_owned()),
            Just("-5000-01-15".to_owned()),
            Just("-4713-11-24".to_owned()),
            Just("0000-01-01".to_owned()),
            Just("+10000-01-01".to_owned()),
            Just("9999-12-31".to_owned()),
            (-300_000i32..300_000, 1u32..13, 1u32..32).prop_map(|(y, m, d)| format!("{y:+07}-{m:02}-{d:02}")),
            (1i32..10_000, 1u32..13, 1u32..29).prop_map(|(y, m, d)| format!("{y:04}-{m:02}-{d:02}")),
        ]
    }

    /// A body that is valid for its route, then has 0..=2 of its fields (or a new one)
    /// replaced by a generated value of any type; now and then not an object at all.
    pub fn body(valid: fn() -> Value, keys: &'static [&'static str]) -> impl Strategy<Value = Value> {
        let field = prop_oneof![3 => date().prop_map(Value::String), 4 => value()];
        (
            prop::collection::vec((prop::sample::select(keys), field), 0..3),
            prop::option::weighted(0.2, (nasty_string(), value())),
            prop::bool::weighted(0.05),
            value(),
        )
            .prop_map(move |(fields, extra, not_an_object, other)| {
                if not_an_object {
                    return other;
                }
                let mut m = match valid() {
                    Value::Object(m) => m,
                    _ => unreachable!("valid bodies are objects"),
                };
                for (k, v) in fields {
                    m.insert(k.to_owned(), v);
                }
                if let Some((k, v)) = extra {
                    m.insert(k, v);
                }
                Value::Object(m)
            })
    }

    /// A `from`/`to` value: mostly a timestamp at some year, sometimes anything.
    fn timestamp() -> impl Strategy<Value = String> {
        prop_oneof![
            3 => (-300_000i32..300_000).prop_map(|y| format!("{y:+07}-06-01T12:00:00Z")),
            2 => (1i32..10_000).prop_map(|y| format!("{y:04}-06-01T12:00:00Z")),
            1 => date(),
            1 => query_value(),
        ]
        .prop_map(|s| s.replace('+', "%2B"))
    }

    fn query_value() -> impl Strategy<Value = String> {
        nasty_string().prop_map(|s| {
            s.bytes()
                .map(|b| if b.is_ascii_alphanumeric() || b"-._~".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") })
                .collect()
        })
    }

    pub fn hostile() -> impl Strategy<Value = super::Hostile> {
        use super::Hostile;
        prop_oneof![
            body(|| json!({ "subject": "s" }), &["id", "subject"]).prop_map(Hostile::Referral),
            (
                prop_oneof![Just(uuid::Uuid::now_v7().to_string()), Just(uuid::Uuid::nil().to_string()), "[a-z0-9%]{0,40}"],
                body(|| json!({ "care_level": "standard", "start": "2026-12-01" }), &["care_level", "start", "referral_id"]),
            )
                .prop_map(|(id, body)| Hostile::Activate { id, body }),
            prop_oneof![query_value().prop_map(|v| format!("size={v}")), (0u64..5000).prop_map(|n| format!("size={n}")), Just(String::new())]
                .prop_map(|query| Hostile::Export { query }),
            (
                prop::sample::select(&["cases", "rules"][..]),
                timestamp(),
                timestamp(),
                prop::option::of(query_value()),
                prop::option::of(query_value()),
            )
                .prop_map(|(service, from, to, et, dry)| {
                    let mut q = format!("from={from}&to={to}");
                    if let Some(et) = et {
                        q.push_str(&format!("&event_type={et}"));
                    }
                    if let Some(d) = dry {
                        q.push_str(&format!("&dry_run={d}"));
                    }
                    Hostile::Replay { service, query: q }
                }),
            prop::collection::vec(any::<u8>(), 0..64).prop_map(Hostile::RawReferral),
        ]
    }

    /// Header bytes a client can send: visible ASCII, spaces, obs-text.
    fn header_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(prop_oneof![4 => 0x21u8..0x7f, 1 => Just(b' '), 1 => 0x80u8..=0xff], 0..max)
            .prop_map(|mut v| {
                // A header value may not start or end with a space.
                while v.first() == Some(&b' ') {
                    v.remove(0);
                }
                while v.last() == Some(&b' ') {
                    v.pop();
                }
                v
            })
    }

    pub fn headers() -> impl Strategy<Value = super::Headers> {
        (
            prop_oneof![
                6 => Just(Some(uuid::Uuid::now_v7().to_string().into_bytes())),
                1 => Just(None),
                2 => header_bytes(300).prop_map(Some),
                1 => Just(Some(vec![b'k'; 256])),
                1 => Just(Some(b"a:b".to_vec())),
            ],
            prop_oneof![
                6 => Just(None),
                1 => header_bytes(80).prop_map(Some),
                1 => header_bytes(80).prop_map(|t| Some([b"Bearer ".as_slice(), &t].concat())),
                1 => Just(Some(format!("Bearer {}.{}.{}", "e".repeat(500), "x", "y").into_bytes())),
            ],
            prop_oneof![
                4 => Just(Some(b"application/json".to_vec())),
                1 => Just(None),
                1 => header_bytes(40).prop_map(Some),
            ],
        )
            .prop_map(|(key, authorization, content_type)| super::Headers { key, authorization, content_type })
    }
}

/// Issue 21.3: generated bodies (extreme dates, huge and negative numbers, long and
/// non-ASCII strings, wrong JSON types, NUL) and headers (keys, tokens and content types
/// valid, hostile or missing) to every route of a cases node and a rules node's replay.
/// Each gets an HTTP answer, never a dropped connection, and never a 5xx while the
/// database is up.
/// `PROPTEST_CASES` raises the count (default 128).
#[test]
fn hostile_bodies_get_an_answer_and_never_a_5xx() {
    use proptest::test_runner::{Config, TestCaseError, TestRunner};
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (fleet, cases, rules) = rt.block_on(async {
        let fleet = Fleet::new("hardening_hostile", &[Service::Cases, Service::Rules]).await;
        let cases = fleet.start(Service::Cases, &[("RUST_LOG", "error")], &[]).await;
        let rules = fleet.start(Service::Rules, &[("RUST_LOG", "error")], &[]).await;
        (fleet, cases, rules)
    });
    let http = reqwest::Client::builder().timeout(Duration::from_secs(20)).build().unwrap();
    let (cases_user, rules_admin) = (token("craig-cases", "cases.admin"), token("craig-rules", "rules.admin"));
    let cases_n = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(128);
    let mut runner = TestRunner::new(Config { cases: cases_n, failure_persistence: None, ..Config::default() });
    let result = runner.run(&(strategies::hostile(), strategies::headers()), |(req, headers)| {
        let base = &cases.base;
        let mut user = &cases_user;
        let builder = match &req {
            Hostile::Referral(v) => http.post(format!("{base}/v1/cases/referrals")).json(v),
            Hostile::RawReferral(b) => {
                http.post(format!("{base}/v1/cases/referrals")).header("content-type", "application/json").body(b.clone())
            }
            Hostile::Activate { id, body } => http.post(format!("{base}/v1/cases/placements/{id}/activate")).json(body),
            Hostile::Export { query } => http.post(format!("{base}/v1/cases/exports?{query}")),
            Hostile::Replay { service: "rules", query } => {
                user = &rules_admin;
                http.post(format!("{}/v1/rules/admin/events/replay?{query}", rules.base))
            }
            Hostile::Replay { service, query } => http.post(format!("{base}/v1/{service}/admin/events/replay?{query}")),
        };
        let value = |b: &[u8]| reqwest::header::HeaderValue::from_bytes(b).expect("generated header bytes are valid");
        let mut builder = match &headers.authorization {
            None => builder.bearer_auth(user),
            Some(raw) => builder.header("authorization", value(raw)),
        };
        if let Some(k) = &headers.key {
            builder = builder.header("idempotency-key", value(k));
        }
        if let Some(ct) = &headers.content_type {
            builder = builder.header("content-type", value(ct));
        }
        let answered = rt.block_on(async { builder.send().await.map(|r| r.status()) });
        match answered {
            Err(e) => Err(TestCaseError::fail(format!("no HTTP answer to {req:?} with {headers:?}: {e}"))),
            Ok(status) if status.is_server_error() => Err(TestCaseError::fail(format!("{status} to {req:?} with {headers:?}"))),
            Ok(_) => Ok(()),
        }
    });
    // The node is still there and well after all of it.
    let healthy = rt.block_on(async { http.get(format!("{}/healthz", cases.base)).send().await.map(|r| r.status().is_success()) });
    let stopped = rt.block_on(cases.stop());
    let rules_stopped = rt.block_on(rules.stop());
    rt.block_on(fleet.finish());
    if let Err(e) = result {
        panic!("{e}");
    }
    assert!(matches!(healthy, Ok(true)), "the node stopped answering: {healthy:?}");
    assert_eq!((stopped.code(), rules_stopped.code()), (Some(0), Some(0)), "a node did not exit cleanly");
}
