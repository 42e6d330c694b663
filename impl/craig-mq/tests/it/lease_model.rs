//! The #1128 claim-lease protocol as a state machine: a pure reference model of rows,
//! claims (with their owner and generation) and leases, and the real SQL (`outbox::lease`)
//! on a real PostgreSQL run against it step by step. Two workers claim, stamp, release and
//! crash; time passes by backdating claims past the lease. After every step the table must
//! equal the model, a claim must return exactly the rows the model says are claimable (a row
//! under a live lease is never handed to a second worker), and a stamp or release must be
//! Applied or Stale exactly where the model says: a worker whose lease expired and whose row
//! was re-claimed changes nothing.
//!
//! `unfenced_release_is_caught` keeps the mutation that matters: a release matched by id
//! alone (the pre-fencing SQL) lets a stale worker clear a live claim, and the model must
//! catch it.
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

#[derive(Debug, Clone, Copy, PartialEq)]
struct Claim {
    owner: usize,
    generation: u64,
    expired: bool,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct Row {
    published: bool,
    claim: Option<Claim>,
    attempts: i32,
}

#[derive(Debug, Clone, Default)]
struct Model {
    rows: Vec<Row>,
    /// (row, claim generation) each worker believes it holds.
    inflight: [Vec<(usize, u64)>; WORKERS],
    /// What the last claim took: (row, whether its previous claim had expired).
    last_claimed: Vec<(usize, bool)>,
    /// What the last stamp or release did: (applied, stale).
    last_fence: (usize, usize),
    generations: u64,
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
            .filter(|&i| !self.rows[i].published && self.rows[i].claim.is_none_or(|c| c.expired))
            .take(BATCH as usize)
            .collect()
    }

    /// Whether `generation` is still the live claim on row `i` (the fence).
    fn holds(&self, i: usize, generation: u64) -> bool {
        !self.rows[i].published && self.rows[i].claim.is_some_and(|c| c.generation == generation)
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
                    m.last_claimed.push((i, m.rows[i].claim.is_some()));
                    m.generations += 1;
                    m.rows[i].claim = Some(Claim { owner: w, generation: m.generations, expired: false });
                    // A worker re-claiming its own expired row holds it once, under the new claim.
                    m.inflight[w].retain(|(r, _)| *r != i);
                    m.inflight[w].push((i, m.generations));
                }
            }
            // Fenced stamp: only the live claim publishes.
            Step::Stamp(w) => {
                m.last_fence = (0, 0);
                for (i, g) in std::mem::take(&mut m.inflight[w]) {
                    if m.holds(i, g) {
                        m.rows[i].published = true;
                        m.rows[i].claim = None;
                        m.last_fence.0 += 1;
                    } else {
                        m.last_fence.1 += 1;
                    }
                }
            }
            // Fenced release: a stale worker cannot clear another worker's live claim.
            Step::Release(w) => {
                m.last_fence = (0, 0);
                for (i, g) in std::mem::take(&mut m.inflight[w]) {
                    if m.holds(i, g) {
                        m.rows[i].claim = None;
                        m.rows[i].attempts += 1;
                        m.last_fence.0 += 1;
                    } else {
                        m.last_fence.1 += 1;
                    }
                }
            }
            Step::Crash(w) => m.inflight[w].clear(),
            Step::Expire => {
                for r in &mut m.rows {
                    if let Some(c) = &mut r.claim {
                        c.expired = true;
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
    inflight: [Vec<lease::Held>; WORKERS],
    /// The mutation under test: release matched by id alone, as before fencing.
    unfenced_release: bool,
}

static CASE: AtomicU32 = AtomicU32::new(0);

impl Sut {
    fn new(label: &str) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let n = CASE.fetch_add(1, Ordering::Relaxed);
        let env = rt.block_on(common::env(&format!("{label}_{n}")));
        Sut { rt, env: Some(env), ids: vec![], inflight: Default::default(), unfenced_release: false }
    }

    fn pool(&self) -> &sqlx::PgPool {
        &self.env.as_ref().expect("env").pool
    }

    /// Apply `step`; `after` is the model with the step applied. Err names the divergence.
    fn step(&mut self, after: &Model, step: &Step) -> Result<(), String> {
        match *step {
            Step::Stage(k) => {
                for _ in 0..k {
                    // One statement each: created_at strictly increases, as in the model's order.
                    let ids = self.rt.block_on(self.env.as_ref().unwrap().stage(1, 1));
                    self.ids.extend(ids);
                }
            }
            Step::Claim(w) => {
                let rows = self.rt.block_on(lease::claim(self.pool(), LEASE, BATCH)).unwrap();
                let got: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
                let want: Vec<Uuid> = after.last_claimed.iter().map(|(i, _)| self.ids[*i]).collect();
                if got != want {
                    return Err(format!("claim returned {got:?}, the claimable rows are {want:?}"));
                }
                // A previous claim is reported exactly for rows whose lease had expired.
                let reclaimed: Vec<bool> = rows.iter().map(|r| r.previous_claim.is_some()).collect();
                let expected: Vec<bool> = after.last_claimed.iter().map(|(_, expired)| *expired).collect();
                if reclaimed != expected {
                    return Err(format!("reclaim flags {reclaimed:?}, expected {expected:?}"));
                }
                for r in rows {
                    self.inflight[w].retain(|h| h.id != r.id);
                    self.inflight[w].push(lease::Held { id: r.id, claim: r.claim });
                }
            }
            Step::Stamp(w) => {
                let held = std::mem::take(&mut self.inflight[w]);
                let fenced = self.rt.block_on(lease::stamp(self.pool(), &held)).unwrap();
                self.fence_matches("stamp", &fenced, after)?;
            }
            Step::Release(w) => {
                let failed: Vec<lease::Failure> = std::mem::take(&mut self.inflight[w])
                    .into_iter()
                    .map(|held| lease::Failure { held, error: "connection: test".into(), retry_in: None })
                    .collect();
                let fenced = if self.unfenced_release {
                    self.rt.block_on(release_by_id_alone(self.pool(), &failed))
                } else {
                    self.rt.block_on(lease::release(self.pool(), &failed)).unwrap()
                };
                self.fence_matches("release", &fenced, after)?;
            }
            Step::Crash(w) => self.inflight[w].clear(),
            Step::Expire => {
                // Time passes: every claim ages past the lease. The fences workers hold age
                // with it (they ARE the claimed_at values).
                self.rt
                    .block_on(
                        sqlx::query("UPDATE event_outbox SET claimed_at = claimed_at - interval '61 seconds' WHERE claimed_at IS NOT NULL")
                            .execute(self.pool()),
                    )
                    .unwrap();
                for held in self.inflight.iter_mut().flatten() {
                    held.claim -= chrono::Duration::seconds(61);
                }
            }
        }
        self.compare(after)
    }

    fn fence_matches(&self, what: &str, fenced: &lease::Fenced, after: &Model) -> Result<(), String> {
        let got = (fenced.applied.len(), fenced.stale.len());
        if got != after.last_fence {
            return Err(format!("{what}: (applied, stale) = {got:?}, the model says {:?}", after.last_fence));
        }
        Ok(())
    }

    fn compare(&self, model: &Model) -> Result<(), String> {
        let rows: Vec<(Uuid, bool, bool, i32)> = self
            .rt
            .block_on(
                sqlx::query_as("SELECT id, published_at IS NOT NULL, claimed_at IS NOT NULL, attempts FROM event_outbox")
                    .fetch_all(self.pool()),
            )
            .unwrap();
        if rows.len() != model.rows.len() {
            return Err(format!("{} rows, the model has {}", rows.len(), model.rows.len()));
        }
        for (id, published, claimed, attempts) in rows {
            let i = self.ids.iter().position(|x| *x == id).expect("known row");
            let m = &model.rows[i];
            let want = (m.published, m.claim.is_some(), m.attempts);
            if (published, claimed, attempts) != want {
                return Err(format!("row {i}: (published, claimed, attempts) = {:?}, the model says {want:?}", (published, claimed, attempts)));
            }
        }
        Ok(())
    }

    fn finish(mut self) {
        let env = self.env.take().unwrap();
        self.rt.block_on(env.finish());
    }
}

/// The mutation: release as it was before fencing, matched by id alone.
async fn release_by_id_alone(pool: &sqlx::PgPool, failed: &[lease::Failure]) -> lease::Fenced {
    let ids: Vec<Uuid> = failed.iter().map(|f| f.held.id).collect();
    let applied: Vec<Uuid> = sqlx::query_scalar(
        "UPDATE event_outbox SET claimed_at = NULL, attempts = attempts + 1, last_error = 'connection: test' \
         WHERE id = ANY($1) AND published_at IS NULL RETURNING id",
    )
    .bind(&ids)
    .fetch_all(pool)
    .await
    .unwrap();
    let stale = ids.iter().filter(|id| !applied.contains(id)).copied().collect();
    lease::Fenced { applied, stale }
}

impl StateMachineTest for Sut {
    type SystemUnderTest = Self;
    type Reference = LeaseModel;

    fn init_test(_: &Model) -> Self {
        Sut::new("lease_model")
    }

    /// `after` is the reference state with `step` already applied (proptest-state-machine).
    fn apply(mut sut: Self, after: &Model, step: Step) -> Self {
        if let Err(why) = sut.step(after, &step) {
            panic!("after {step:?}: {why}");
        }
        sut
    }

    fn teardown(sut: Self, _: Model) {
        sut.finish();
    }
}

/// Worker 0 claims, stalls past its lease, worker 1 re-claims and is publishing; worker 0's
/// publish fails and it releases. Fenced, that release is Stale and worker 1's claim stands;
/// the pre-fencing SQL clears it, and the model must say so.
#[test]
fn unfenced_release_is_caught() {
    let steps = [Step::Stage(1), Step::Claim(0), Step::Expire, Step::Claim(1), Step::Release(0)];
    let run = |unfenced: bool| {
        let mut sut = Sut::new("lease_mutant");
        sut.unfenced_release = unfenced;
        let mut model = Model::default();
        let mut verdict = Ok(());
        for step in &steps {
            model = LeaseModel::apply(model, step);
            verdict = sut.step(&model, step);
            if verdict.is_err() {
                break;
            }
        }
        sut.finish();
        verdict
    };
    assert_eq!(run(false), Ok(()), "the fenced release must match the model");
    let caught = run(true).expect_err("the unfenced release must diverge from the model");
    assert!(caught.starts_with("release: (applied, stale) = (1, 0), the model says (0, 1)"), "{caught}");
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
