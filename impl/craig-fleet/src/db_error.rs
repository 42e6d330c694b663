//! One reading of a database error for every handler (§D3 subscriber, #1197 DLQ consumer):
//! does retrying make sense, and is the database there at all?

/// What a failed statement says about retrying it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbFailure {
    /// The database refused THIS data (SQLSTATE class 22 data exception, class 23 integrity
    /// violation, or a value the driver could not encode): the same row fails every time.
    Data,
    /// The database is not reachable (I/O, TLS, pool timed out or closed, class 08
    /// connection exception, class 57 operator intervention such as a shutdown).
    Unreachable,
    /// Anything else (a serialization failure, a lock timeout, …): may pass on a retry.
    Other,
}

pub fn classify(e: &sqlx::Error) -> DbFailure {
    match e {
        sqlx::Error::Database(db) => db.code().as_deref().map_or(DbFailure::Other, classify_code),
        sqlx::Error::Encode(_) => DbFailure::Data,
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Tls(_) => DbFailure::Unreachable,
        _ => DbFailure::Other,
    }
}

/// What a SQLSTATE says (see [`classify`]).
pub fn classify_code(c: &str) -> DbFailure {
    if c.starts_with("22") || c.starts_with("23") {
        DbFailure::Data
    } else if c.starts_with("08") || c.starts_with("57P") || matches!(c, "53300" | "25006" | "28000" | "28P01" | "3D000") {
        // Connection exceptions; the server shutting down or not yet up (57P01..57P05,
        // never 57014: a cancelled or timed-out statement is THIS statement's failure);
        // too many connections; a read-only standby (a failover under way); the credential
        // or the database gone: each fails every statement alike.
        DbFailure::Unreachable
    } else {
        DbFailure::Other
    }
}

/// The subscriber's verdict for a handler's database error: refused data is permanent
/// (dead-lettered), everything else transient (requeued, and surfaced by the retry cap).
pub fn handler_error(e: sqlx::Error) -> craig_mq::subscriber::HandlerError {
    use craig_mq::subscriber::HandlerError;
    match classify(&e) {
        DbFailure::Data => HandlerError::Permanent(e.to_string()),
        DbFailure::Unreachable | DbFailure::Other => HandlerError::Transient(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_failures_are_unreachable_and_encoding_is_data() {
        assert_eq!(classify(&sqlx::Error::PoolTimedOut), DbFailure::Unreachable);
        assert_eq!(classify(&sqlx::Error::Io(std::io::Error::other("reset"))), DbFailure::Unreachable);
        assert_eq!(classify(&sqlx::Error::Encode("NUL in text".into())), DbFailure::Data);
        assert_eq!(classify(&sqlx::Error::RowNotFound), DbFailure::Other);
    }

    /// Issue 21.1 (audit): a statement timeout (57014) is the statement's own failure,
    /// counted toward the DLQ's park cap; a shutdown (57P01) or too many clients (53300) is
    /// the database's, never counted.
    #[test]
    fn a_statement_timeout_is_not_an_outage() {
        assert_eq!(classify_code("57014"), DbFailure::Other);
        for c in ["57P01", "57P03", "08006", "53300", "25006", "28P01", "3D000"] {
            assert_eq!(classify_code(c), DbFailure::Unreachable, "{c}");
        }
        assert_eq!(classify_code("22021"), DbFailure::Data);
        assert_eq!(classify_code("40001"), DbFailure::Other);
    }
}
