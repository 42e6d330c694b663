//! craig-fleet's integration tests: real `craig-node` processes, in one binary.

mod access;
mod app_path;
mod common;
#[cfg(feature = "failpoints")]
mod crash;
mod financial;
mod hardening;
mod node;
mod retention;
mod security;
mod send_jobs;
