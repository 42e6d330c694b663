//! `craig-fleet`: the four demo services of CONTRACT § fleet, built on `craig-mq` and
//! `craig-api`, and the `craig-node` binary that runs one of them.

pub mod access;
pub mod cases;
pub mod cli;
pub mod compat;
pub mod consumer;
pub mod db_error;
pub mod financial;
pub mod node;
pub mod rules;
pub mod security;
pub mod send_jobs;
pub mod service;

pub use compat::{Compat, CompatSet};
pub use service::Service;
