//! leasehold's behaviour through its public API, by concern: one test binary (one build, one
//! link) for every suite that needs no process of its own.
//!
//! Apart, each in a binary of its own, are the suites whose state is process-wide: child
//! processes and their orphan checks (`processes`, `process_escape`, `quarantine`, `shutdown`,
//! `where_features_meet`, `pool_controls`), counts of the whole process (`job_shape`), a global
//! tracing subscriber (`flood`), a driver library's lifetime in the process
//! (`gpu_driver_lifetime`); and the broker conformance gallery (`broker_conformance`), which
//! cargo-mutants runs alone. The GPU suites are the `gpu` binary.

#[path = "../common/mod.rs"]
mod common;

mod actor_jobs;
mod architecture;
mod cancellation_matrix;
mod errors_and_priority;
mod frame_loop;
mod imports;
mod lifecycle;
mod observability;
mod outside_calls;
mod physical_completion;
mod seed_behaviours;
mod temp_dir;
