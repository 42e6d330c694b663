//! craig-api's integration tests: the §D5 middleware over real TCP (reqwest) on a real
//! Postgres database (one sandbox per test), and its state machine against a model.

mod common;
mod idempotency;
mod model;
