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

/// Test-only mutants (issue 22): one-line departures from the ADR the harness arms to show a
/// checker goes red for them (`[[faults]] kind = "mutant"`), never a behaviour a
/// deployment could choose. Armed with the action `return(on)`.
///
/// | name | departure |
/// |---|---|
/// | `financial::absorb_fails` | #1179's absorb path errors (transiently) instead of absorbing a replay: the delivery retries to the cap and is dead-lettered on the app path |
/// | `cases::stage_after_commit` | §D1 broken: the referral commits in one transaction and its event is staged in a second |
/// | `cases::activation_stage_after_commit` | §D1 broken for activations: the placement turns active in one transaction and `placement.activated` is staged in a second |
/// | `cases::stage_before_write` | §D1 broken the other way: the referral's event commits in a transaction of its own before the referral's, so a referral that fails to commit leaves its event published (a phantom) |
/// | `cases::activation_stage_before_write` | the same for activations: `placement.activated` commits in a transaction of its own before the placement turns active, so an activation that fails to commit leaves its event published (a payment for a placement cases does not hold active) |
pub const MUTANTS: &[&str] = &[
    "financial::absorb_fails",
    "cases::stage_after_commit",
    "cases::activation_stage_after_commit",
    "cases::stage_before_write",
    "cases::activation_stage_before_write",
];

/// Test-only faults: what the environment does to a replica that no proxy can time to the
/// microsecond. Armed like the mutants (`return(on)`; `1*return(on)` for the first hit only).
///
/// | name | fault |
/// |---|---|
/// | `exports::commit_ack_lost` | an export's statement runs and its answer is lost: the handler sees a transport error (seen under a link cut at the commit). Each hit is one statement: the INSERT, then the read-back |
pub const FAULTS: &[&str] = &["exports::commit_ack_lost"];

/// Whether test-only fault `name` fires on this hit (always false without feature
/// `failpoints`); it says so when it does (`failpoint.fault`).
#[inline]
pub fn fault(name: &'static str) -> bool {
    armed(name, "failpoint.fault")
}

/// Whether mutant `name` is armed (always false without feature `failpoints`). Each time it
/// changes behaviour it says so (`failpoint.mutant`): the evidence that it fired.
#[inline]
pub fn mutant(name: &'static str) -> bool {
    armed(name, "failpoint.mutant")
}

/// Whether failpoint `name` answers `return(on)` on this hit; if so, logs `event` (the
/// evidence the harness reads). Always false without feature `failpoints`.
#[inline]
fn armed(name: &'static str, event: &'static str) -> bool {
    #[cfg(feature = "failpoints")]
    if let Some(Some(arg)) = fail::eval(name, |arg| arg) {
        if arg == "on" {
            tracing::warn!(event, failpoint = name, "test-only failpoint changed behaviour");
            return true;
        }
    }
    let _ = (name, event);
    false
}

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
