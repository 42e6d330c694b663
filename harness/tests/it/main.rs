//! The harness's integration tests, in one binary (one link, one set of monomorphized
//! dependencies: the build budget on two cores depends on it).

mod amqp_faults;
mod backends;
mod cluster;
mod properties;
mod proxy;
mod replicas;
mod runs;
