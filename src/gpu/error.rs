//! `GpuError`: what the pool reports.

use std::fmt;

/// A GPU failure of the pool.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum GpuError {
    /// No acceptable adapter was found (`GPU_UNAVAILABLE`).
    NoAdapter,
    /// A device could not be created (`GPU_UNAVAILABLE`).
    CreateFailed(String),
    /// The device was lost, or its backend panicked (`LEASE_GPU_DEVICE_LOST`).
    DeviceLost(String),
}

impl GpuError {
    /// `GPU_UNAVAILABLE` or `LEASE_GPU_DEVICE_LOST`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::NoAdapter | Self::CreateFailed(_) => "GPU_UNAVAILABLE",
            Self::DeviceLost(_) => "LEASE_GPU_DEVICE_LOST",
        }
    }
}

impl fmt::Display for GpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoAdapter => f.write_str("no acceptable gpu adapter"),
            Self::CreateFailed(m) => write!(f, "gpu device creation failed: {m}"),
            Self::DeviceLost(m) => write!(f, "gpu device lost: {m}"),
        }
    }
}

impl std::error::Error for GpuError {}
