//! `craig-chaos`: the ADR-022 chaos-verification harness.
//!
//! Dependencies run one way: scenario → faults → history → checkers → report.
//!
//! | module | what |
//! |---|---|
//! | [`scenario`] | scenario files: parsing with file/line errors |
//! | [`runner`] | runs a scenario: backend, proxies, replicas, workload, faults, drain |
//! | [`report`] | report.json, report.md, timeline.svg, history.jsonl |
//! | [`history`] | what happened in a run (`history.jsonl`) |
//! | [`checkers`] | invariants as pure functions of a history |
//! | [`backend`] | where PostgreSQL and RabbitMQ come from: local, external, containers |
//! | [`proxy`] | Toxiproxy-compatible fault proxy and its API client |
//! | [`process`] | fleet replicas as child processes: signals, restarts, logs |

pub mod backend;
pub mod bench;
pub mod checkers;
pub mod history;
pub mod process;
pub mod proxy;
pub mod report;
pub mod runner;
pub mod scenario;
