//! No data crosses leases (DESIGN.md invariant 10) on the GPU: a slot's scratch buffers are
//! zeroed when a lease takes them (`JobGpu::scratch`), by a clear submitted on the queue before
//! anything the lease submits after it, unless the caller opts out with
//! `ScratchPolicy::Reused`. A lease that never takes its scratch costs no clear. Runs on any
//! backend (see `tests/gpu/devices.rs`).

use crate::common;
use crate::gpu_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::EventLog;
use gpu_support::{bytes, dispatch, fill_job, map_readback, pattern, read_back, start};
use leasehold::{BackendCall, FencePolicy, GpuOptions, JobSpec, ScratchPolicy, Supervisor, wgpu};

const WORDS: u64 = 64;

/// What the next lease found: `(readback as left, storage copied out)`, and whether it ran on
/// the same scratch buffers as the first.
struct Seen {
    readback: Vec<u32>,
    storage: Vec<u32>,
    same_sub_slot: bool,
}

/// How the first lease leaves its readback buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leave {
    /// Mapped, read and unmapped.
    Unmapped,
    /// Mapped (the mapping completed), never unmapped.
    Mapped,
    /// A mapping asked for and never waited for.
    MapPending,
}

/// Runs a job that writes `pattern` into both scratch buffers (and leaves its readback buffer
/// as `leave` says), then a second job on the same single sub-slot that reads what it was
/// handed.
async fn write_then_look(sup: &Supervisor, leave: Leave) -> Seen {
    let first = sup
        .run(JobSpec::new("writer").unwrap(), move |ctx| async move {
            let gpu = ctx.gpu().unwrap().clone();
            let storage = gpu.scratch().storage.clone();
            ctx.spawn_blocking(move || {
                let scratch = gpu.scratch();
                gpu.queue()
                    .write_buffer(&scratch.storage, 0, &bytes(&pattern(WORDS)));
                let mut encoder = gpu.device().create_command_encoder(&Default::default());
                encoder.copy_buffer_to_buffer(&scratch.storage, 0, &scratch.readback, 0, WORDS * 4);
                gpu.submit([encoder.finish()]);
                match leave {
                    Leave::Unmapped => assert_eq!(map_readback(&gpu, WORDS), pattern(WORDS)),
                    Leave::Mapped => {
                        scratch
                            .readback
                            .map_async(wgpu::MapMode::Read, .., |r| r.unwrap());
                        gpu.device()
                            .poll(wgpu::PollType::wait_indefinitely())
                            .unwrap();
                    }
                    // Its callback hears the mapping aborted when the next lease's clear ends
                    // it.
                    Leave::MapPending => {
                        scratch.readback.map_async(wgpu::MapMode::Read, .., |_| ());
                    }
                }
            })
            .await
            .unwrap();
            Ok::<_, std::io::Error>(storage)
        })
        .await
        .unwrap();
    sup.run(JobSpec::new("reader").unwrap(), move |ctx| async move {
        let gpu = ctx.gpu().unwrap().clone();
        let same_sub_slot = gpu.scratch().storage == first;
        let seen = ctx
            .spawn_blocking(move || Seen {
                readback: map_readback(&gpu, WORDS),
                storage: read_back(&gpu, WORDS),
                same_sub_slot,
            })
            .await
            .unwrap();
        Ok::<_, std::io::Error>(seen)
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_lease_on_the_same_sub_slot_reads_zeros_after_the_first_wrote_a_pattern() {
    for fence in [FencePolicy::Queue, FencePolicy::Recorded] {
        for leave in [Leave::Unmapped, Leave::Mapped, Leave::MapPending] {
            let opts = GpuOptions::new().fence_policy(fence);
            let Some(sup) = start(Supervisor::builder(), opts).await else {
                return;
            };
            let seen = write_then_look(&sup, leave).await;
            let case = format!("{fence:?}, readback left {leave:?}");
            assert!(seen.same_sub_slot, "{case}: not the same scratch buffers");
            assert_eq!(seen.readback, vec![0; WORDS as usize], "{case}: readback");
            assert_eq!(seen.storage, vec![0; WORDS as usize], "{case}: storage");
            let report = sup.shutdown().await.unwrap();
            assert_eq!(report.quarantined, 0, "{case}");
        }
    }
}

/// The opt-out does what it says (and shows that the zeros above are the clear's doing): the
/// next lease is handed the scratch as the last one left it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reused_scratch_policy_hands_the_scratch_on_as_the_last_lease_left_it() {
    let opts = GpuOptions::new().scratch_policy(ScratchPolicy::Reused);
    let Some(sup) = start(Supervisor::builder(), opts).await else {
        return;
    };
    let seen = write_then_look(&sup, Leave::Unmapped).await;
    assert!(seen.same_sub_slot);
    assert_eq!(seen.readback, pattern(WORDS));
    assert_eq!(seen.storage, pattern(WORDS));
    sup.shutdown().await.unwrap();
}

/// A scratch wgpu refuses to clear (here: the job destroyed it) is replaced by new buffers,
/// which wgpu zero-initialises: the next lease still reads zeros, and its slot works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scratch_that_cannot_be_cleared_is_replaced_by_a_zeroed_one() {
    let Some(sup) = start(Supervisor::builder(), GpuOptions::new()).await else {
        return;
    };
    let destroyed = sup
        .run(JobSpec::new("vandal").unwrap(), |ctx| async move {
            let gpu = ctx.gpu().unwrap().clone();
            ctx.spawn_blocking(move || {
                gpu.queue()
                    .write_buffer(&gpu.scratch().storage, 0, &bytes(&pattern(WORDS)));
                gpu.submit(std::iter::empty());
                gpu.scratch().storage.destroy();
                gpu.scratch().storage.clone()
            })
            .await
            .map_err(std::io::Error::other)
        })
        .await
        .unwrap();
    let (same, words) = sup
        .run(JobSpec::new("next").unwrap(), move |ctx| async move {
            let gpu = ctx.gpu().unwrap().clone();
            let same = gpu.scratch().storage == destroyed;
            let words = ctx
                .spawn_blocking(move || read_back(&gpu, WORDS))
                .await
                .unwrap();
            Ok::<_, std::io::Error>((same, words))
        })
        .await
        .unwrap();
    assert!(!same, "the destroyed scratch was handed on");
    assert_eq!(words, vec![0; WORDS as usize]);
    assert_eq!(
        sup.gpu_device_generation(0),
        Some(1),
        "the device was not lost"
    );
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
}

/// A write still running on the GPU when its lease ends (submitted on the queue directly, which
/// `FencePolicy::Recorded` does not wait for) is never seen by the next lease: its take of the
/// scratch queues the clear after that write. Where the backend runs work asynchronously
/// (Vulkan), the write is seen in flight (its completion callback not fired, after a poll) when
/// the next lease takes the scratch; on GL, wgpu runs it inside the submission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_still_in_flight_when_its_lease_ends_is_cleared_before_the_next_lease_reads() {
    let opts = GpuOptions::new().fence_policy(FencePolicy::Recorded);
    let Some(sup) = start(Supervisor::builder(), opts).await else {
        return;
    };
    let done = Arc::new(AtomicBool::new(false));
    let written = Arc::clone(&done);
    let asynchronous = sup
        .run(JobSpec::new("writer").unwrap(), move |ctx| async move {
            let gpu = ctx.gpu().unwrap().clone();
            // About half a second of GPU work on lavapipe, writing the scratch's first 512 KiB.
            gpu.queue().submit([dispatch(&gpu, "long", 2048)]);
            let flag = Arc::clone(&written);
            gpu.queue()
                .on_submitted_work_done(move || flag.store(true, Ordering::SeqCst));
            let _ = gpu.device().poll(wgpu::PollType::Poll);
            Ok::<_, std::io::Error>(!written.load(Ordering::SeqCst))
        })
        .await
        .unwrap();
    let (in_flight, words) = sup
        .run(JobSpec::new("reader").unwrap(), move |ctx| async move {
            let gpu = ctx.gpu().unwrap().clone();
            let _ = gpu.device().poll(wgpu::PollType::Poll);
            let in_flight = !done.load(Ordering::SeqCst);
            let _ = gpu.scratch();
            let words = ctx
                .spawn_blocking(move || read_back(&gpu, WORDS))
                .await
                .unwrap();
            Ok::<_, std::io::Error>((in_flight, words))
        })
        .await
        .unwrap();
    eprintln!("the write ran asynchronously: {asynchronous}; in flight at the take: {in_flight}");
    assert_eq!(words, vec![0; WORDS as usize], "the in-flight write leaked");
    if asynchronous {
        assert!(
            in_flight,
            "the write had completed before the next lease took the scratch: the test did \
             not see the case it is about"
        );
    }
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
}

/// The clear happens when the lease takes its scratch, in the job, before the job's own
/// submission; the release after it neither clears nor submits. A lease that never takes its
/// scratch costs no clear. Seen through the backend hook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scratch_is_cleared_when_a_lease_takes_it_and_only_then() {
    let log = EventLog::default();
    let calls = log.clone();
    let opts = GpuOptions::new().backend_hook(move |call, _device, _sub| {
        if matches!(
            call,
            BackendCall::ZeroScratch
                | BackendCall::Submit
                | BackendCall::FenceSubmit
                | BackendCall::FenceWait
        ) {
            calls.push(format!("{call:?}"));
        }
    });
    let Some(sup) = start(Supervisor::builder(), opts).await else {
        return;
    };
    for (job, takes) in [("takes", true), ("leaves", false), ("takes-again", true)] {
        let marks = log.clone();
        sup.run(JobSpec::new(job).unwrap(), move |ctx| async move {
            let gpu = ctx.gpu().unwrap();
            marks.push(format!("{job}-start"));
            if takes {
                gpu.submit([dispatch(gpu, "fill", 1)]);
            } else {
                // GPU work of its own, on a buffer of its own.
                gpu.submit([gpu
                    .device()
                    .create_command_encoder(&Default::default())
                    .finish()]);
            }
            marks.push(format!("{job}-end"));
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap();
    }
    assert_eq!(
        log.events(),
        [
            "takes-start",
            "ZeroScratch",
            "Submit",
            "takes-end",
            "FenceWait",
            "leaves-start",
            "Submit",
            "leaves-end",
            "FenceWait",
            "takes-again-start",
            "ZeroScratch",
            "Submit",
            "takes-again-end",
            "FenceWait",
        ]
    );
    sup.shutdown().await.unwrap();
}

/// A `JobGpu` kept past its lease (returned by the body here) submits nothing and hands out no
/// scratch once the lease's fence has begun: the sub-slot and its scratch serve the next lease,
/// and work submitted through the kept handle would be nobody's to wait for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_gpu_kept_past_its_lease_submits_nothing_and_gets_no_scratch() {
    for fence in [FencePolicy::Queue, FencePolicy::Recorded] {
        let opts = GpuOptions::new().fence_policy(fence);
        let Some(sup) = start(Supervisor::builder(), opts).await else {
            return;
        };
        let kept = sup
            .run(JobSpec::new("keeps").unwrap(), |ctx| async move {
                let gpu = ctx.gpu().unwrap().clone();
                // Used during the lease, as a job would.
                let _ = gpu.scratch();
                gpu.submit([dispatch(&gpu, "fill", 1)]);
                Ok::<_, std::io::Error>(gpu)
            })
            .await
            .unwrap();
        let submitted = kept.try_submit(std::iter::empty());
        let err = submitted.expect_err("a submission through a handle kept past its lease");
        assert_eq!(err.code(), "LEASE_RELEASED", "{fence:?}: {err}");
        let err = kept.try_scratch().map(|_| ()).unwrap_err();
        assert_eq!(err.code(), "LEASE_RELEASED", "{fence:?}: {err}");
        // The next lease on the same sub-slot works as ever.
        let words = fill_job(&sup, "next").await.unwrap();
        assert_eq!(words, [1, 3, 5, 7], "{fence:?}");
        drop(kept);
        let report = sup.shutdown().await.unwrap();
        assert_eq!(report.quarantined, 0, "{fence:?}");
    }
}
