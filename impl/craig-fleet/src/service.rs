//! The four demo services (CONTRACT § fleet) and what each declares, consumes and migrates.

use std::fmt;
use std::str::FromStr;

use sqlx::migrate::Migrator;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Service {
    Cases,
    Financial,
    Rules,
    Security,
}

pub const ALL: [Service; 4] = [Service::Cases, Service::Financial, Service::Rules, Service::Security];

static CASES: Migrator = sqlx::migrate!("../../migrations/cases");
static FINANCIAL: Migrator = sqlx::migrate!("../../migrations/financial");
static RULES: Migrator = sqlx::migrate!("../../migrations/rules");
static SECURITY: Migrator = sqlx::migrate!("../../migrations/security");

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

    /// Routing keys this build's node actually CONSUMES (runs a subscriber for) — a subset
    /// of [`queue_bindings`](Self::queue_bindings).
    pub fn consumes(self) -> &'static [&'static str] {
        match self {
            Service::Rules => &["case.referral_created"],
            // security: the wildcard audit subscriber (and, beside it, the DLQ consumer).
            Service::Security => &["#"],
            // financial (placement.activated) arrives with the arbiter work.
            Service::Cases | Service::Financial => &[],
        }
    }

    /// The `aud` value a bearer token needs for this service's routes.
    pub fn audience(self) -> String {
        format!("craig-{}", self.name())
    }
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
