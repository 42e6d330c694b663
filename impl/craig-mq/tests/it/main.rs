//! craig-mq's integration tests on real PostgreSQL and RabbitMQ, in one binary.

mod common;
mod inbox;
mod lease_model;
mod outbox;
mod endpoints;
mod subscriber;
