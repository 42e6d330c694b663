//! `craig-chaos`: the ADR-022 chaos-verification harness.
//!
//! Dependencies run one way: scenario → faults → history → checkers → report.
//!
//! | module | what |
//! |---|---|
//! | [`proxy`] | Toxiproxy-compatible fault proxy and its API client |

pub mod proxy;
