//! Prometheus instruments of the event path (CONTRACT § Metrics), through the `metrics`
//! facade: this crate only records; the binary installs the exporter and serves
//! `GET /metrics`. Without an installed recorder every call is a no-op.
//!
//! | name | kind | recorded by |
//! |---|---|---|
//! | `outbox_depth` | gauge | the outbox worker after every drain: rows with `published_at IS NULL` |
//! | `outbox_publish_lag_seconds` | histogram | each stamped row: commit (`created_at`) to broker ACK |
//! | `outbox_published_total` | counter | rows stamped `published_at` |
//! | `outbox_publish_errors_total{kind}` | counter | rows released unpublished: `nacked`, `confirm_timeout`, `connection`, `unroutable`, `malformed` |
//! | `inbox_dedup_hits_total` | counter | deliveries the inbox absorbed (already processed) |
//! | `inbox_processed_total` | counter | first executions of a handler |
//! | `inbox_reprocessed_total` | counter | re-executions of an unstamped envelope (the #1180 window) |
//! | `dlq_queue_depth` | gauge | the DLQ consumer, every second: ready messages on `craig-security.dlq` (#1199) |
//! | `dlq_outcomes_total{outcome}` | counter | each DLQ delivery's fate (#1199): `recorded` (a new audit row, tokened or tokenless), `duplicate` (a redelivered occurrence absorbed), `quarantined` (malformed bytes or a divergent token, recorded as such), `retried`, `parked`, `captured` (confirmed capture publish), `redriven` (a captured delivery recorded by a capture redrive, beside its `recorded`/`duplicate`/`quarantined`), `redrive_kept` (one a redrive found still refused, put back), `acked_unrecorded` (compat `pre-1197` only) |
//!
//! ADR-022's LISTEN/NOTIFY abandonment criterion reads the first two (depth p95 > 500, lag
//! p95 > 5 s over 24 h).

use std::time::Duration;

pub const OUTBOX_DEPTH: &str = "outbox_depth";
pub const OUTBOX_PUBLISH_LAG: &str = "outbox_publish_lag_seconds";
pub const OUTBOX_PUBLISHED: &str = "outbox_published_total";
pub const OUTBOX_PUBLISH_ERRORS: &str = "outbox_publish_errors_total";
pub const INBOX_DEDUP_HITS: &str = "inbox_dedup_hits_total";
pub const INBOX_PROCESSED: &str = "inbox_processed_total";
pub const INBOX_REPROCESSED: &str = "inbox_reprocessed_total";
pub const DLQ_QUEUE_DEPTH: &str = "dlq_queue_depth";
/// Pending outbox rows older than the grace (#965/#1129: kept forever, the operator signal).
pub const OUTBOX_UNPUBLISHED_BEYOND_GRACE: &str = "outbox_unpublished_beyond_grace";
pub const DLQ_OUTCOMES: &str = "dlq_outcomes_total";

/// Every `outcome` label `dlq_outcomes_total` can carry.
pub const DLQ_OUTCOMES_LABELS: &[&str] =
    &["recorded", "duplicate", "quarantined", "retried", "parked", "captured", "redriven", "redrive_kept", "acked_unrecorded"];

/// Every `kind` label `outbox_publish_errors_total` can carry.
pub const PUBLISH_ERROR_KINDS: &[&str] = &["nacked", "confirm_timeout", "connection", "unroutable", "malformed"];

/// Register descriptions and zero every series, so a scrape shows each name from the start
/// (a counter that never moved is a fact worth seeing, not a missing line).
pub fn describe() {
    metrics::describe_gauge!(OUTBOX_DEPTH, "Outbox rows not yet ACKed by the broker (published_at IS NULL)");
    metrics::describe_gauge!(
        OUTBOX_UNPUBLISHED_BEYOND_GRACE,
        "Pending outbox rows older than the grace: kept forever by the prune, the evidence of an undelivered event"
    );
    metrics::describe_histogram!(OUTBOX_PUBLISH_LAG, metrics::Unit::Seconds, "Outbox commit to broker ACK");
    metrics::describe_counter!(OUTBOX_PUBLISHED, "Outbox rows stamped published after a broker ACK");
    metrics::describe_counter!(OUTBOX_PUBLISH_ERRORS, "Outbox rows released unpublished, by failure kind");
    metrics::describe_counter!(INBOX_DEDUP_HITS, "Deliveries absorbed by the inbox (already processed)");
    metrics::describe_counter!(INBOX_PROCESSED, "Envelopes whose handler ran for the first time");
    metrics::describe_counter!(INBOX_REPROCESSED, "Envelopes re-run after a handler ran without its processed_at stamp (#1180)");
    metrics::describe_gauge!(DLQ_QUEUE_DEPTH, "Ready dead letters on craig-security.dlq (sampled by the DLQ consumer)");
    metrics::describe_counter!(DLQ_OUTCOMES, "DLQ deliveries by outcome (#1199); no event_type label (#1205 honesty note)");
    metrics::gauge!(OUTBOX_DEPTH).set(0.0);
    metrics::gauge!(DLQ_QUEUE_DEPTH).set(0.0);
    metrics::gauge!(OUTBOX_UNPUBLISHED_BEYOND_GRACE).set(0.0);
    // Issue 21.8: the histogram registered at zero count renders its buckets from the start.
    let _ = metrics::histogram!(OUTBOX_PUBLISH_LAG);
    for outcome in DLQ_OUTCOMES_LABELS {
        metrics::counter!(DLQ_OUTCOMES, "outcome" => *outcome).increment(0);
    }
    for name in [OUTBOX_PUBLISHED, INBOX_DEDUP_HITS, INBOX_PROCESSED, INBOX_REPROCESSED] {
        metrics::counter!(name).increment(0);
    }
    for kind in PUBLISH_ERROR_KINDS {
        metrics::counter!(OUTBOX_PUBLISH_ERRORS, "kind" => *kind).increment(0);
    }
}

pub(crate) fn outbox_depth(rows: i64) {
    metrics::gauge!(OUTBOX_DEPTH).set(rows as f64);
}

pub(crate) fn publish_lag(lag: Duration) {
    metrics::histogram!(OUTBOX_PUBLISH_LAG).record(lag.as_secs_f64());
}

pub(crate) fn published(rows: usize) {
    metrics::counter!(OUTBOX_PUBLISHED).increment(rows as u64);
}

pub(crate) fn publish_error(kind: &'static str) {
    metrics::counter!(OUTBOX_PUBLISH_ERRORS, "kind" => kind).increment(1);
}

pub(crate) fn inbox(outcome: crate::inbox::InboxOutcome) {
    use crate::inbox::InboxOutcome;
    let name = match outcome {
        InboxOutcome::Processed => INBOX_PROCESSED,
        InboxOutcome::Reprocessed => INBOX_REPROCESSED,
        InboxOutcome::Duplicate => INBOX_DEDUP_HITS,
    };
    metrics::counter!(name).increment(1);
}

/// One DLQ delivery's outcome (`dlq_outcomes_total{outcome}`); `outcome` is one of
/// [`DLQ_OUTCOMES_LABELS`].
pub fn dlq_outcome(outcome: &'static str) {
    debug_assert!(DLQ_OUTCOMES_LABELS.contains(&outcome), "unknown dlq outcome {outcome}");
    metrics::counter!(DLQ_OUTCOMES, "outcome" => outcome).increment(1);
}

pub(crate) fn dlq_queue_depth(ready: u32) {
    metrics::gauge!(DLQ_QUEUE_DEPTH).set(f64::from(ready));
}
