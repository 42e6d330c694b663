//! The #1128 claim-lease protocol as a state machine: a pure reference model of rows,
//! claims and leases, and the real SQL (`outbox::lease`) on a real PostgreSQL run
//! against it step by step. Two workers claim, stamp, release and crash; time passes by
//! backdating claims past the lease. After every step the table must equal the model,
//! and a claim must return exactly the rows the model says are claimable — so a row under
//! a live lease is never handed to a second worker.
//!
//! `PROPTEST_CASES` sets the number of sequences (default 12).



use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use craig_mq::outbox::lease;

use crate::common;
use proptest::prelude::*;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use uuid::Uuid;

const BATCH: u32 = 3;
const LEASE: Duration = Duration::from_secs(60);
const WORKERS: usize = 2;

#[derive(Debug, Clone, Default, PartialEq)]
struct Row {
    published: bool,
    /// Some(expired?) while claimed.
    claim: Option<bool>,
    attempts: i32,
}

#[derive(Debug, Clone, Default)]
struct Model {
    rows: Vec<Row>,
    /// Row indices each worker believes it holds.
    inflight: [Vec<usize>; WORKERS],
    /// What the last claim took: (row, whether its previous claim had expired).
    last_claimed: Vec<(usize, bool)>,
}

#[derive(Debug, Clone)]
enum Step {
    Stage(usize),
    Claim(usize),
    Stamp(usize),
    Release(usize),
    Crash(usize),
    Expire,
}

impl Model {
    fn claimable(&self) -> Vec<usize> {
        (0..self.rows.len())
            .filter(|&i| !self.rows[i].published && self.rows[i].claim.is_none_or(|expired| expired))
            .take(BATCH as usize)
            .collect()
    }
}

struct LeaseModel;

impl ReferenceStateMachine for LeaseModel {
    type State = Model;
    type Transition = Step;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::default()).boxed()
    }

    fn transitions(_: &Model) -> BoxedStrategy<Step> {
        let w = 0..WORKERS;
        prop_oneof![
            2 => (1usize..4).prop_map(Step::Stage),
            3 => w.clone().prop_map(Step::Claim),
            2 => w.clone().prop_map(Step::Stamp),
            2 => w.clone().prop_map(Step::Release),
            1 => w.prop_map(Step::Crash),
            1 => Just(Step::Expire),
        ]
        .boxed()
    }

    fn apply(mut m: Model, step: &Step) -> Model {
        match *step {
            Step::Stage(k) => m.rows.extend(std::iter::repeat_n(Row::default(), k)),
            Step::Claim(w) => {
                m.last_claimed.clear();
                for i in m.claimable() {
                    m.last_claimed.push((i, m.rows[i].claim == Some(true)));
                    m.rows[i].claim = Some(false);
                    // A worker re-claiming its own expired row holds it once.
                    if !m.inflight[w].contains(&i) {
                        m.inflight[w].push(i);
                    }
                }
            }
            // Unguarded stamp (#1185): a stale worker's stamp still publishes.
            Step::Stamp(w) => {
                for i in std::mem::take(&mut m.inflight[w]) {
                    m.rows[i].published = true;
                    m.rows[i].claim = None;
                }
            }
            Step::Release(w) => {
                for i in std::mem::take(&mut m.inflight[w]) {
                    if !m.rows[i].published {
                        m.rows[i].claim = None;
                        m.rows[i].attempts += 1;
                    }
                }
            }
            Step::Crash(w) => m.inflight[w].clear(),
            Step::Expire => {
                for r in &mut m.rows {
                    if r.claim.is_some() {
                        r.claim = Some(true);
                    }
                }
            }
        }
        m
    }
}

struct Sut {
    rt: tokio::runtime::Runtime,
    env: Option<common::Env>,
    ids: Vec<Uuid>,
    inflight: [Vec<Uuid>; WORKERS],
}

impl Sut {
    fn pool(&self) -> &sqlx::PgPool {
        &self.env.as_ref().expect("env").pool
    }
}

static CASE: AtomicU32 = AtomicU32::new(0);

impl StateMachineTest for Sut {
    type SystemUnderTest = Self;
    type Reference = LeaseModel;

    fn init_test(_: &Model) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let n = CASE.fetch_add(1, Ordering::Relaxed);
        let env = rt.block_on(common::env(&format!("lease_model_{n}")));
        Sut { rt, env: Some(env), ids: vec![], inflight: Default::default() }
    }

    /// `after` is the reference state with `step` already applied (proptest-state-machine).
    fn apply(mut sut: Self, after: &Model, step: Step) -> Self {
        match step {
            Step::Stage(k) => {
                for _ in 0..k {
                    // One statement each: created_at strictly increases, as in the model's order.
                    let ids = sut.rt.block_on(sut.env.as_ref().unwrap().stage(1, 1));
                    sut.ids.extend(ids);
                }
            }
            Step::Claim(w) => {
                let rows = sut.rt.block_on(lease::claim(sut.pool(), LEASE, BATCH)).unwrap();
                let got: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
                let want: Vec<Uuid> = after.last_claimed.iter().map(|(i, _)| sut.ids[*i]).collect();
                assert_eq!(got, want, "claim must return exactly the claimable rows, oldest first");
                // A previous claim is reported exactly for rows whose lease had expired.
                let reclaimed: Vec<bool> = rows.iter().map(|r| r.2.is_some()).collect();
                let expected: Vec<bool> = after.last_claimed.iter().map(|(_, expired)| *expired).collect();
                assert_eq!(reclaimed, expected, "reclaim flags");
                for id in got {
                    if !sut.inflight[w].contains(&id) {
                        sut.inflight[w].push(id);
                    }
                }
            }
            Step::Stamp(w) => {
                let ids = std::mem::take(&mut sut.inflight[w]);
                sut.rt.block_on(lease::stamp(sut.pool(), &ids)).unwrap();
            }
            Step::Release(w) => {
                let failed: Vec<(Uuid, String)> =
                    std::mem::take(&mut sut.inflight[w]).into_iter().map(|id| (id, "connection: test".into())).collect();
                sut.rt.block_on(lease::release(sut.pool(), &failed)).unwrap();
            }
            Step::Crash(w) => sut.inflight[w].clear(),
            Step::Expire => {
                sut.rt
                    .block_on(
                        sqlx::query("UPDATE event_outbox SET claimed_at = claimed_at - interval '61 seconds' WHERE claimed_at IS NOT NULL")
                            .execute(sut.pool()),
                    )
                    .unwrap();
            }
        }
        sut
    }

    fn check_invariants(sut: &Self, model: &Model) {
        let rows: Vec<(Uuid, bool, bool, i32)> = sut
            .rt
            .block_on(
                sqlx::query_as("SELECT id, published_at IS NOT NULL, claimed_at IS NOT NULL, attempts FROM event_outbox")
                    .fetch_all(sut.pool()),
            )
            .unwrap();
        assert_eq!(rows.len(), model.rows.len());
        for (id, published, claimed, attempts) in rows {
            let i = sut.ids.iter().position(|x| *x == id).expect("known row");
            let m = &model.rows[i];
            assert_eq!((published, claimed, attempts), (m.published, m.claim.is_some(), m.attempts), "row {i}");
        }
    }

    fn teardown(mut sut: Self, _: Model) {
        let env = sut.env.take().unwrap();
        sut.rt.block_on(env.finish());
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(12)
}

prop_state_machine! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 64,
        failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::Direct(
            "../../fixtures/proptest-regressions/lease-model.txt",
        ))),
        .. ProptestConfig::default()
    })]

    #[test]
    fn claim_lease_protocol_matches_the_model(sequential 1..40 => Sut);
}
