//! What the console's tests share: a supervisor on a work root of its own, and a job body that
//! makes its slot's cleanup fail (so that the console has a quarantined slot to show).

#![allow(dead_code)]

/// A supervisor with `slots` slots whose temp dirs live in a fresh directory (kept alive by the
/// returned `TempDir`).
pub async fn pool(slots: u32) -> (leasehold::Supervisor, tempfile::TempDir) {
    let root = tempfile::tempdir().unwrap();
    let sup = leasehold::Supervisor::builder()
        .slots(slots)
        .work_root(root.path())
        .start()
        .await
        .unwrap();
    (sup, root)
}

/// Replaces the job's temp dir by a regular file of the same name, so that the supervisor's
/// removal of it as a directory fails and the slot is quarantined. Returns the path.
pub fn clobber_temp_dir(ctx: &leasehold::WorkerContext) -> std::io::Result<std::path::PathBuf> {
    let dir = ctx.temp_dir().to_path_buf();
    std::fs::remove_dir(&dir)?;
    std::fs::write(&dir, b"not a directory")?;
    Ok(dir)
}
