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
    /// [`Supervisor::replace_device`](crate::Supervisor::replace_device) was refused: no such
    /// device, a device leasehold opened itself (it re-creates those), no GPU, or a
    /// supervisor that has closed its devices (`GPU_REPLACE_REFUSED`). Nothing was installed.
    ReplaceRefused(String),
    /// A [`JobGpu`](crate::JobGpu) kept past its lease: the lease's GPU work has been fenced,
    /// and its sub-slot and scratch may already serve another lease, so nothing more is
    /// submitted or handed out through it (`LEASE_RELEASED`).
    LeaseEnded,
}

impl GpuError {
    /// `GPU_UNAVAILABLE`, `LEASE_GPU_DEVICE_LOST`, `GPU_REPLACE_REFUSED` or `LEASE_RELEASED`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::NoAdapter | Self::CreateFailed(_) => "GPU_UNAVAILABLE",
            Self::DeviceLost(_) => "LEASE_GPU_DEVICE_LOST",
            Self::ReplaceRefused(_) => "GPU_REPLACE_REFUSED",
            Self::LeaseEnded => "LEASE_RELEASED",
        }
    }
}

impl fmt::Display for GpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoAdapter => f.write_str("no acceptable gpu adapter"),
            Self::CreateFailed(m) => write!(f, "gpu device creation failed: {m}"),
            Self::DeviceLost(m) => write!(f, "gpu device lost: {m}"),
            Self::ReplaceRefused(m) => write!(f, "gpu device replacement refused: {m}"),
            Self::LeaseEnded => f.write_str(
                "the lease of this gpu handle has ended: its sub-slot may serve another lease",
            ),
        }
    }
}

impl std::error::Error for GpuError {}
