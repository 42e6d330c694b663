//! The four demo services (CONTRACT § fleet) and what each declares, consumes and migrates.

use std::fmt;
use std::str::FromStr;
use std::sync::LazyLock;

use sqlx::migrate::Migrator;

use crate::compat::{Compat, CompatSet};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Service {
    Cases,
    Financial,
    Rules,
    Security,
}

pub const ALL: [Service; 4] = [Service::Cases, Service::Financial, Service::Rules, Service::Security];

/// `migrations/<service>/`, embedded by `build.rs`.
mod embedded {
    include!(concat!(env!("OUT_DIR"), "/migrations.rs"));
}

fn embedded(files: &'static [(i64, &'static str, &'static str)]) -> Migrator {
    use sqlx::migrate::{Migration, MigrationType};
    Migrator::with_migrations(
        files
            .iter()
            .map(|(version, description, sql)| {
                // As sqlx's resolver reads a file: a leading `-- no-transaction` opts out.
                let no_tx = sql.starts_with("-- no-transaction");
                Migration::new(*version, (*description).into(), MigrationType::Simple, sqlx::SqlStr::from_static(sql), no_tx)
            })
            .collect(),
    )
}

static CASES: LazyLock<Migrator> = LazyLock::new(|| embedded(embedded::CASES));
static FINANCIAL: LazyLock<Migrator> = LazyLock::new(|| embedded(embedded::FINANCIAL));
static RULES: LazyLock<Migrator> = LazyLock::new(|| embedded(embedded::RULES));
static SECURITY: LazyLock<Migrator> = LazyLock::new(|| embedded(embedded::SECURITY));

impl Service {
    pub fn name(self) -> &'static str {
        match self {
            Service::Cases => "cases",
            Service::Financial => "financial",
            Service::Rules => "rules",
            Service::Security => "security",
        }
    }

    /// `migrations/<service>/`, embedded at build time.
    pub fn migrator(self) -> &'static Migrator {
        match self {
            Service::Cases => &CASES,
            Service::Financial => &FINANCIAL,
            Service::Rules => &RULES,
            Service::Security => &SECURITY,
        }
    }

    /// The schema a fleet running `compat` had: every migration of
    /// [`migrator`](Self::migrator) except those an amendment the modes revert introduced
    /// ([`AMENDMENT_MIGRATIONS`]). `craig-node migrate --compat pre-1179` leaves the #1179
    /// payments arbiter out, so an old handler meets the table it was written for.
    pub fn schema(self, compat: &CompatSet) -> Migrator {
        let skipped: Vec<i64> = AMENDMENT_MIGRATIONS
            .iter()
            .filter(|(mode, svc, _)| *svc == self && compat.has(*mode))
            .map(|(.., version)| *version)
            .collect();
        Migrator::with_migrations(self.migrator().iter().filter(|m| !skipped.contains(&m.version)).cloned().collect())
    }

    /// Routing keys this service's consumer queue `craig-<service>.events` binds on
    /// `craig.events` in a deployed fleet (CONTRACT § fleet): what `craig-node topology`
    /// declares and what each node declares for itself at start. security's wildcard audit
    /// queue takes every event (`#`).
    pub fn queue_bindings(self) -> &'static [&'static str] {
        match self {
            Service::Cases => &[],
            Service::Financial => &["placement.activated"],
            Service::Rules => &["case.referral_created"],
            Service::Security => &["#"],
        }
    }

    /// Routing keys this build's node actually CONSUMES (runs a subscriber for): the same as
    /// [`queue_bindings`](Self::queue_bindings) for every service (tested), so each node's
    /// subscriber declares the queue it binds.
    pub fn consumes(self) -> &'static [&'static str] {
        match self {
            Service::Rules => &["case.referral_created"],
            // security: the wildcard audit subscriber (and, beside it, the DLQ consumer).
            Service::Security => &["#"],
            // financial: the #1179 arbiter-backed per-diem payment consumer.
            Service::Financial => &["placement.activated"],
            Service::Cases => &[],
        }
    }

    /// The `aud` value a bearer token needs for this service's routes.
    pub fn audience(self) -> String {
        format!("craig-{}", self.name())
    }
}

/// Migrations an amendment introduced, as (the compat mode that reverts it, service,
/// version): the schema before the amendment is the current one without them.
pub const AMENDMENT_MIGRATIONS: &[(Compat, Service, i64)] = &[
    // #1179: payments_one_perdiem_per_placement_period.
    (Compat::Pre1179, Service::Financial, 20261201000200),
];

/// The service that consumes events of `event_type` in a deployed fleet (the wildcard audit
/// queue aside): whose consumer queue a dead letter of that type comes from.
pub fn consumer_of(event_type: &str) -> Option<Service> {
    ALL.into_iter().find(|s| *s != Service::Security && s.consumes().contains(&event_type))
}

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown service {0:?}; expected one of cases, financial, rules, security")]
pub struct UnknownService(String);

impl FromStr for Service {
    type Err = UnknownService;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ALL.into_iter().find(|svc| svc.name() == s).ok_or_else(|| UnknownService(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pre_1179_schema_is_the_current_one_without_the_payments_arbiter() {
        let all: Vec<i64> = Service::Financial.migrator().iter().map(|m| m.version).collect();
        let old: Vec<i64> =
            Service::Financial.schema(&CompatSet::new([Compat::Pre1179])).iter().map(|m| m.version).collect();
        assert!(all.contains(&20261201000200), "{all:?}");
        assert_eq!(old, all.iter().copied().filter(|v| *v != 20261201000200).collect::<Vec<_>>());
        let current: Vec<i64> = Service::Financial.schema(&CompatSet::default()).iter().map(|m| m.version).collect();
        assert_eq!(current, all);
        // Another service's schema is untouched by the mode.
        assert_eq!(Service::Rules.schema(&CompatSet::new([Compat::Pre1179])).iter().count(), Service::Rules.migrator().iter().count());
    }

    /// A node declares its queue through its subscriber (node.rs): a service that bound a
    /// queue it did not consume would leave it undeclared until `craig-node topology` ran.
    #[test]
    fn every_service_consumes_exactly_what_its_queue_binds() {
        for s in ALL {
            assert_eq!(s.consumes(), s.queue_bindings(), "{}", s.name());
        }
    }

    #[test]
    fn each_event_type_has_one_consuming_service() {
        assert_eq!(consumer_of("case.referral_created"), Some(Service::Rules));
        assert_eq!(consumer_of("placement.activated"), Some(Service::Financial));
        assert_eq!(consumer_of("payment.created"), None);
    }
}
