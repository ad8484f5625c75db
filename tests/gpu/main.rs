//! The GPU suites, in one test binary: devices and their sub-slots (`devices`), a lease's
//! scratch (`scratch`), a GPU fault contained to its lease (`containment`), and the engine's
//! own device (`adopt`).
//!
//! Each runs on whatever adapter the machine has; without one it skips loudly, and under
//! `LEASEHOLD_REQUIRE_GPU=1` (CI) a missing adapter fails. CI runs the binary twice: as it comes
//! (Vulkan, lavapipe) and with `WGPU_BACKEND=gl` (GL on EGL, llvmpipe).
#![cfg(feature = "gpu")]

#[path = "../common/mod.rs"]
mod common;
#[path = "../gpu_support/mod.rs"]
mod gpu_support;

mod adopt;
mod containment;
mod devices;
mod scratch;
