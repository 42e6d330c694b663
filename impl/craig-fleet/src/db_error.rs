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
        sqlx::Error::Encode(_) => DbFailure::Data,
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Tls(_) => DbFailure::Unreachable,
        sqlx::Error::Database(db) => match db.code().as_deref().map(|c| c.get(..2).unwrap_or(c)) {
            Some("22" | "23") => DbFailure::Data,
            Some("08" | "57") => DbFailure::Unreachable,
            _ => DbFailure::Other,
        },
        _ => DbFailure::Other,
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
}
