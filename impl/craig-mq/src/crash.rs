//! Crash points for the chaos harness: the windows ADR-022 names as at-least-once residue.
//!
//! | name | window |
//! |---|---|
//! | `outbox::after_claim` | #1128: rows claimed, nothing published — heals by lease expiry |
//! | `outbox::after_publish_before_stamp` | #1128: broker ACKed, `published_at` not stamped — re-published after lease expiry |
//! | `inbox::after_handler_before_stamp` | #1180: handler committed, `processed_at` not stamped — handler re-runs on redelivery |
//! | `dlq::after_record_before_ack` | #1181: the dead letter's audit row committed, the DLQ delivery not acked — redelivered; the occurrence token absorbs it |
//! | `exports::after_commit_before_answer` | §D5 (craig-fleet's exports route): the handler committed, no answer, the claim left `processing` — a retry after the claim expires re-claims (generation 2) and runs it again |
//! | `send_jobs::after_post_before_finalize` | #1185 (craig-fleet's send queue): the partner accepted the POST, the job not finalized — re-sent once the lease expires (at-least-once) |
//!
//! Built only with feature `failpoints` (off by default, so never in a plain release
//! build). Configure with the `fail` crate's `FAILPOINTS` grammar; the action
//! `return(abort)` aborts the whole process (a real crash, SIGABRT), and `N*off->return(abort)`
//! fires on hit N+1. The action `return(hit)` only logs `failpoint.hit` and goes on: a
//! marker the harness can time another fault by. Other `fail` actions (`sleep`, `pause`, `panic`) behave as documented there.

/// The crash point names, for `--help` texts and harness validation.
pub const CRASH_POINTS: &[&str] = &[
    "outbox::after_claim",
    "outbox::after_publish_before_stamp",
    "inbox::after_handler_before_stamp",
    "dlq::after_record_before_ack",
    "send_jobs::after_post_before_finalize",
    "exports::after_commit_before_answer",
];

/// Evaluate crash point `name`. Without feature `failpoints` this is a no-op.
#[inline]
pub fn hit(name: &'static str) {
    #[cfg(feature = "failpoints")]
    if let Some(Some(arg)) = fail::eval(name, |arg| arg) {
        if arg == "hit" {
            // A marker the harness waits for (e.g. to upgrade a replica at the Nth hit).
            tracing::warn!(event = "failpoint.hit", failpoint = name, "crash point reached (marker only)");
        }
        if arg == "abort" {
            tracing::error!(event = "failpoint.abort", failpoint = name, "crash point fired: aborting process");
            eprintln!("craig: crash point {name} fired: aborting");
            std::process::abort();
        }
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Load `FAILPOINTS` from the environment. Keep the guard alive for the process lifetime.
#[cfg(feature = "failpoints")]
pub fn setup_from_env() -> fail::FailScenario<'static> {
    fail::FailScenario::setup()
}
