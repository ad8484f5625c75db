//! No data crosses leases (DESIGN.md invariant 10) on the GPU: a slot's scratch buffers are
//! zeroed after the lease's fence, before the next lease of the sub-slot can see them, unless
//! the caller opts out with `ScratchPolicy::Reused`. Runs on any backend (see `tests/gpu.rs`).
#![cfg(feature = "gpu")]

mod gpu_support;

use gpu_support::{bytes, map_readback, pattern, read_back, start};
use leasehold::{FencePolicy, GpuOptions, JobSpec, ScratchPolicy, Supervisor, wgpu};

const WORDS: u64 = 64;

/// What the next lease found: `(readback as left, storage copied out)`, and whether it ran on
/// the same scratch buffers as the first.
struct Seen {
    readback: Vec<u32>,
    storage: Vec<u32>,
    same_sub_slot: bool,
}

/// Runs a job that writes `pattern` into both scratch buffers (and, with `leave_mapped`, ends
/// with the readback buffer still mapped), then a second job on the same single sub-slot that
/// reads what it was handed.
async fn write_then_look(sup: &Supervisor, leave_mapped: bool) -> Seen {
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
                if leave_mapped {
                    scratch
                        .readback
                        .map_async(wgpu::MapMode::Read, .., |r| r.unwrap());
                    gpu.device()
                        .poll(wgpu::PollType::wait_indefinitely())
                        .unwrap();
                } else {
                    assert_eq!(map_readback(&gpu, WORDS), pattern(WORDS));
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
        for leave_mapped in [false, true] {
            let opts = GpuOptions::new().fence_policy(fence);
            let Some(sup) = start(Supervisor::builder(), opts).await else {
                return;
            };
            let seen = write_then_look(&sup, leave_mapped).await;
            let case = format!("{fence:?}, readback left mapped: {leave_mapped}");
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
    let seen = write_then_look(&sup, false).await;
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
