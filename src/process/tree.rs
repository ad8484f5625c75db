//! A job's process tree, read from `/proc` (Linux). Entries carry their start time, so that a pid
//! the kernel has reused for another process is never mistaken for the one recorded.

use std::collections::HashMap;

/// One process as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcEntry {
    pub(crate) pid: i32,
    pub(crate) ppid: i32,
    pub(crate) pgid: i32,
    pub(crate) start_time: u64,
    pub(crate) zombie: bool,
}

impl ProcEntry {
    fn from_stat(stat: &procfs::process::Stat) -> Self {
        Self {
            pid: stat.pid,
            ppid: stat.ppid,
            pgid: stat.pgrp,
            start_time: stat.starttime,
            zombie: stat.state == 'Z' || stat.state == 'X',
        }
    }
}

fn all() -> Vec<ProcEntry> {
    let Ok(iter) = procfs::process::all_processes() else {
        return Vec::new();
    };
    iter.filter_map(|p| p.ok()?.stat().ok())
        .map(|s| ProcEntry::from_stat(&s))
        .collect()
}

/// Every live descendant of `root` (not `root` itself), whatever its group or session.
pub(crate) fn descendants(root: i32) -> Vec<ProcEntry> {
    let mut children: HashMap<i32, Vec<ProcEntry>> = HashMap::new();
    for e in all() {
        children.entry(e.ppid).or_default().push(e);
    }
    let mut out = Vec::new();
    let mut stack = vec![root];
    while let Some(pid) = stack.pop() {
        for child in children.remove(&pid).unwrap_or_default() {
            stack.push(child.pid);
            out.push(child);
        }
    }
    out
}

/// Every process whose parent is `ppid`.
pub(crate) fn children_of(ppid: i32) -> Vec<ProcEntry> {
    all().into_iter().filter(|e| e.ppid == ppid).collect()
}

/// The process recorded as `entry`, if it still exists (same pid, same start time).
pub(crate) fn current(entry: &ProcEntry) -> Option<ProcEntry> {
    let stat = procfs::process::Process::new(entry.pid).ok()?.stat().ok()?;
    let now = ProcEntry::from_stat(&stat);
    (now.start_time == entry.start_time).then_some(now)
}
