//! An engine that renders with its own wgpu device and leases compute work on that same device.
//!
//! `cargo run --release --example engine_device`
//!
//! The engine creates its device (headless: any adapter, Mesa's software ones included) and
//! hands it to a supervisor with `GpuOptions::adopt`, two sub-slots on it. Its loop renders 120
//! frames at 60 Hz with its own render pipeline. Meanwhile it submits leased jobs that compute
//! fractal tiles on the GPU, each into a texture on the engine's device; the loop polls their
//! handles once a frame and, once a job's `run` has answered (its release came after the
//! lease's fence: the tile is complete), copies the tile into its atlas on the GPU and samples
//! the atlas in the next frame's pass: no copy through the CPU. After the loop the supervisor
//! shuts down and the engine renders one more frame on its device.
//!
//! It writes `out/engine_device/frame-NNN.png` (every 20th frame, and the last) and
//! `out/engine_device/timeline.json` (Chrome / Perfetto trace events: the frames, and each
//! tile's lease by slot).

#[cfg(not(feature = "gpu"))]
fn main() {
    eprintln!("engine_device needs leasehold's `gpu` feature (on by default)");
}

#[cfg(feature = "gpu")]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    app::run()
}

#[cfg(feature = "gpu")]
mod app {
    use std::path::{Path, PathBuf};
    use std::time::{Duration, Instant};

    use leasehold::{GpuOptions, JobHandle, JobSpec, Supervisor, wgpu};

    /// The render target's side, in pixels; the atlas is as large, in 4 × 4 tiles.
    const SIZE: u32 = 256;
    const TILE: u32 = 64;
    const TILES: u32 = (SIZE / TILE) * (SIZE / TILE);
    const FRAMES: u32 = 120;
    const FRAME: Duration = Duration::from_nanos(16_666_667);
    /// Sub-slots on the engine's device, and tile jobs in flight at most.
    const SLOTS: u32 = 2;

    const TILE_SHADER: &str = r#"
struct Params { cx: f32, cy: f32, scale: f32, hue: f32 }
@group(0) @binding(0) var<storage, read_write> px: array<u32>;
@group(0) @binding(1) var<uniform> p: Params;

@compute @workgroup_size(8, 8)
fn tile(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = vec2<f32>(p.cx, p.cy) + (vec2<f32>(gid.xy) / 64.0 - 0.5) * p.scale;
    var z = vec2<f32>(0.0, 0.0);
    var i = 0u;
    loop {
        if (i >= 160u || dot(z, z) > 4.0) { break; }
        z = vec2<f32>(z.x * z.x - z.y * z.y, 2.0 * z.x * z.y) + c;
        i = i + 1u;
    }
    let t = f32(i) / 160.0;
    let r = u32(255.0 * clamp(t * (1.0 + p.hue), 0.0, 1.0));
    let g = u32(255.0 * clamp(t * t * 2.0, 0.0, 1.0));
    let b = u32(255.0 * clamp(sqrt(t) * (1.5 - p.hue), 0.0, 1.0));
    px[gid.y * 64u + gid.x] = r | (g << 8u) | (b << 16u) | (255u << 24u);
}
"#;

    const FRAME_SHADER: &str = r#"
@group(0) @binding(0) var atlas: texture_2d<f32>;
@group(0) @binding(1) var<uniform> time: vec4<f32>;

@vertex
fn vs(@builtin(vertex_index) i: u32) -> @builtin(position) vec4<f32> {
    let xy = vec2<f32>(f32((i << 1u) & 2u), f32(i & 2u));
    return vec4<f32>(xy * 2.0 - 1.0, 0.0, 1.0);
}

@fragment
fn fs(@builtin(position) pos: vec4<f32>) -> @location(0) vec4<f32> {
    let tile = textureLoad(atlas, vec2<i32>(pos.xy), 0);
    let stripe = 0.5 + 0.5 * sin((pos.x + pos.y) * 0.05 - time.x * 4.0);
    let background = vec4<f32>(0.08, 0.1 + 0.1 * stripe, 0.2 + 0.2 * stripe, 1.0);
    return select(background, tile, tile.a > 0.0);
}
"#;

    /// A finished tile: its texture on the engine's device, and the slot that computed it.
    type Tile = (wgpu::Texture, u32);

    /// A trace event: `(name, track, start, end)`.
    type Event = (String, String, Duration, Duration);

    pub fn run() -> Result<(), Box<dyn std::error::Error>> {
        let out = PathBuf::from("out/engine_device");
        std::fs::create_dir_all(&out)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let _enter = rt.enter();

        // The engine's device, the one it renders with. Vulkan alone first, and GL in an
        // instance of its own only without a Vulkan adapter: a device whose instance also holds
        // GL tears EGL down when it is dropped (docs/gpu.md, "Backends").
        let adapter_on = |backends| {
            let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
            desc.backends = backends;
            rt.block_on(wgpu::Instance::new(desc).request_adapter(&Default::default()))
        };
        let found = match wgpu::Backends::from_env() {
            Some(named) => adapter_on(named),
            None => adapter_on(wgpu::Backends::VULKAN).or_else(|_| adapter_on(wgpu::Backends::GL)),
        };
        let adapter = match found {
            Ok(adapter) => adapter,
            Err(e) => {
                if std::env::var("LEASEHOLD_REQUIRE_GPU").as_deref() == Ok("1") {
                    return Err(format!("no GPU adapter: {e}").into());
                }
                eprintln!("*** SKIPPED: engine_device found no GPU adapter ({e}) ***");
                return Ok(());
            }
        };
        let info = adapter.get_info();
        let (device, queue) = rt.block_on(adapter.request_device(&Default::default()))?;
        println!("engine device: {} ({:?})", info.name, info.backend);

        let sup = rt.block_on(
            Supervisor::builder()
                .gpu(
                    GpuOptions::new()
                        .adopt(device.clone(), queue.clone(), info)
                        .slots_per_device(SLOTS),
                )
                .start(),
        )?;
        let engine = Engine::new(&device);
        let tile_pipeline = compute_pipeline(&device);

        let started = Instant::now();
        let mut events: Vec<Event> = Vec::new();
        let mut in_flight: Vec<(u32, Duration, JobHandle<Tile, std::io::Error>)> = Vec::new();
        let (mut next_tile, mut composited) = (0u32, 0u32);
        let mut frame_ms = Vec::with_capacity(FRAMES as usize);
        let mut next_frame = Instant::now();
        for frame in 0..FRAMES {
            let frame_start = started.elapsed();
            let mut encoder = device.create_command_encoder(&Default::default());
            // Finished tiles: into the atlas, on the GPU, in this frame's commands.
            let mut i = 0;
            while i < in_flight.len() {
                match in_flight[i].2.try_take() {
                    None => i += 1,
                    Some(result) => {
                        let (k, submitted, _) = in_flight.swap_remove(i);
                        let (texture, slot) = result?;
                        engine.composite(&mut encoder, &texture, k);
                        composited += 1;
                        events.push((
                            format!("tile {k}"),
                            format!("slot {slot}"),
                            submitted,
                            started.elapsed(),
                        ));
                    }
                }
            }
            // Keep both sub-slots busy: one more tile per free slot.
            while in_flight.len() < SLOTS as usize {
                let k = next_tile;
                next_tile += 1;
                let pipeline = tile_pipeline.clone();
                let handle = sup.submit(JobSpec::new(format!("tile-{k}"))?, move |ctx| {
                    let slot = ctx.slot_id();
                    async move {
                        let gpu = ctx.gpu().expect("a gpu slot").clone();
                        Ok::<_, std::io::Error>((compute_tile(&gpu, &pipeline, k), slot))
                    }
                });
                in_flight.push((k, started.elapsed(), handle));
            }
            engine.draw(&device, &queue, encoder, frame);
            let end = started.elapsed();
            frame_ms.push((end - frame_start).as_secs_f64() * 1e3);
            events.push((format!("frame {frame}"), "engine".into(), frame_start, end));
            // Not part of the frame's work: the PNG's readback waits for the GPU.
            if frame % 20 == 0 {
                engine.save(&device, &queue, &out.join(format!("frame-{frame:03}.png")))?;
            }
            next_frame += FRAME;
            std::thread::sleep(next_frame.saturating_duration_since(Instant::now()));
        }
        // The tiles still in flight end through their release, then the supervisor stops.
        for (k, submitted, handle) in in_flight {
            let (_, slot) = rt.block_on(handle.join())?;
            events.push((
                format!("tile {k}"),
                format!("slot {slot}"),
                submitted,
                started.elapsed(),
            ));
        }
        let report = rt.block_on(sup.shutdown())?;
        // The device is still the engine's: one more frame on it.
        let encoder = device.create_command_encoder(&Default::default());
        engine.draw(&device, &queue, encoder, FRAMES);
        engine.save(&device, &queue, &out.join(format!("frame-{FRAMES:03}.png")))?;
        write_timeline(&out.join("timeline.json"), &events)?;

        frame_ms.sort_by(f64::total_cmp);
        let p99 = frame_ms[(frame_ms.len() * 99 / 100).min(frame_ms.len() - 1)];
        println!(
            "{FRAMES} frames: frame work p50 {:.2} ms, p99 {p99:.2} ms; {composited} tiles \
             composited from leases on the engine's device; after shutdown ({} slots quarantined) \
             the engine rendered frame {FRAMES}",
            frame_ms[frame_ms.len() / 2],
            report.quarantined,
        );
        println!("wrote {}", out.display());
        Ok(())
    }

    fn compute_pipeline(device: &wgpu::Device) -> wgpu::ComputePipeline {
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("tile"),
            source: wgpu::ShaderSource::Wgsl(TILE_SHADER.into()),
        });
        device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("tile"),
            layout: None,
            module: &module,
            entry_point: Some("tile"),
            compilation_options: Default::default(),
            cache: None,
        })
    }

    /// The leased job: tile `k` of the fractal into its slot's scratch, copied into a texture on
    /// the engine's device; submitted through the lease, so its release waits for it.
    fn compute_tile(
        gpu: &leasehold::JobGpu,
        pipeline: &wgpu::ComputePipeline,
        k: u32,
    ) -> wgpu::Texture {
        let device = gpu.device();
        let cell = k % TILES;
        let zoom = 0.5f32.powi((k / TILES) as i32 % 4);
        let (x, y) = ((cell % 4) as f32, (cell / 4) as f32);
        let scale = 0.75 * zoom;
        let params = [
            -0.75 + (x - 1.5) * scale,
            (y - 1.5) * scale,
            scale,
            (k / TILES % 2) as f32 * 0.5,
        ];
        let uniform = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("tile params"),
            size: 16,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let bytes: Vec<u8> = params.iter().flat_map(|f| f.to_le_bytes()).collect();
        gpu.queue().write_buffer(&uniform, 0, &bytes);
        let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: gpu.scratch().storage.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: uniform.as_entire_binding(),
                },
            ],
        });
        let texture = device.create_texture(&wgpu::TextureDescriptor {
            label: Some("tile"),
            size: extent(TILE),
            mip_level_count: 1,
            sample_count: 1,
            dimension: wgpu::TextureDimension::D2,
            format: wgpu::TextureFormat::Rgba8Unorm,
            usage: wgpu::TextureUsages::COPY_DST | wgpu::TextureUsages::COPY_SRC,
            view_formats: &[],
        });
        let mut encoder = device.create_command_encoder(&Default::default());
        {
            let mut pass = encoder.begin_compute_pass(&Default::default());
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(TILE / 8, TILE / 8, 1);
        }
        encoder.copy_buffer_to_texture(
            wgpu::TexelCopyBufferInfo {
                buffer: &gpu.scratch().storage,
                layout: wgpu::TexelCopyBufferLayout {
                    offset: 0,
                    bytes_per_row: Some(TILE * 4),
                    rows_per_image: Some(TILE),
                },
            },
            texture.as_image_copy(),
            extent(TILE),
        );
        gpu.submit([encoder.finish()]);
        texture
    }

    fn extent(side: u32) -> wgpu::Extent3d {
        wgpu::Extent3d {
            width: side,
            height: side,
            depth_or_array_layers: 1,
        }
    }

    /// The engine's own rendering: an atlas of finished tiles, a render pipeline that samples
    /// it over an animated background, and the render target.
    struct Engine {
        atlas: wgpu::Texture,
        target: wgpu::Texture,
        time: wgpu::Buffer,
        bind: wgpu::BindGroup,
        pipeline: wgpu::RenderPipeline,
        readback: wgpu::Buffer,
    }

    impl Engine {
        fn new(device: &wgpu::Device) -> Self {
            let texture = |label, usage| {
                device.create_texture(&wgpu::TextureDescriptor {
                    label: Some(label),
                    size: extent(SIZE),
                    mip_level_count: 1,
                    sample_count: 1,
                    dimension: wgpu::TextureDimension::D2,
                    format: wgpu::TextureFormat::Rgba8Unorm,
                    usage,
                    view_formats: &[],
                })
            };
            let atlas = texture(
                "atlas",
                wgpu::TextureUsages::TEXTURE_BINDING | wgpu::TextureUsages::COPY_DST,
            );
            let target = texture(
                "target",
                wgpu::TextureUsages::RENDER_ATTACHMENT | wgpu::TextureUsages::COPY_SRC,
            );
            let time = device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("time"),
                size: 16,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some("frame"),
                source: wgpu::ShaderSource::Wgsl(FRAME_SHADER.into()),
            });
            let pipeline = device.create_render_pipeline(&wgpu::RenderPipelineDescriptor {
                label: Some("frame"),
                layout: None,
                vertex: wgpu::VertexState {
                    module: &module,
                    entry_point: Some("vs"),
                    compilation_options: Default::default(),
                    buffers: &[],
                },
                fragment: Some(wgpu::FragmentState {
                    module: &module,
                    entry_point: Some("fs"),
                    compilation_options: Default::default(),
                    targets: &[Some(wgpu::TextureFormat::Rgba8Unorm.into())],
                }),
                primitive: Default::default(),
                depth_stencil: None,
                multisample: Default::default(),
                multiview_mask: None,
                cache: None,
            });
            let view = atlas.create_view(&Default::default());
            let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &pipeline.get_bind_group_layout(0),
                entries: &[
                    wgpu::BindGroupEntry {
                        binding: 0,
                        resource: wgpu::BindingResource::TextureView(&view),
                    },
                    wgpu::BindGroupEntry {
                        binding: 1,
                        resource: time.as_entire_binding(),
                    },
                ],
            });
            let readback = device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("readback"),
                size: u64::from(SIZE * SIZE * 4),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            Self {
                atlas,
                target,
                time,
                bind,
                pipeline,
                readback,
            }
        }

        /// A finished tile into its cell of the atlas (a GPU copy).
        fn composite(&self, encoder: &mut wgpu::CommandEncoder, tile: &wgpu::Texture, k: u32) {
            let cell = k % TILES;
            let mut dst = self.atlas.as_image_copy();
            dst.origin = wgpu::Origin3d {
                x: (cell % 4) * TILE,
                y: (cell / 4) * TILE,
                z: 0,
            };
            encoder.copy_texture_to_texture(tile.as_image_copy(), dst, extent(TILE));
        }

        /// One frame: the composites recorded in `encoder`, then the pass over the atlas.
        fn draw(
            &self,
            device: &wgpu::Device,
            queue: &wgpu::Queue,
            mut encoder: wgpu::CommandEncoder,
            frame: u32,
        ) {
            let t = frame as f32 / 60.0;
            let bytes: Vec<u8> = [t, 0.0, 0.0, 0.0]
                .iter()
                .flat_map(|f| f.to_le_bytes())
                .collect();
            queue.write_buffer(&self.time, 0, &bytes);
            let view = self.target.create_view(&Default::default());
            {
                let mut pass = encoder.begin_render_pass(&wgpu::RenderPassDescriptor {
                    label: Some("frame"),
                    color_attachments: &[Some(wgpu::RenderPassColorAttachment {
                        view: &view,
                        depth_slice: None,
                        resolve_target: None,
                        ops: wgpu::Operations {
                            load: wgpu::LoadOp::Clear(wgpu::Color::BLACK),
                            store: wgpu::StoreOp::Store,
                        },
                    })],
                    ..Default::default()
                });
                pass.set_pipeline(&self.pipeline);
                pass.set_bind_group(0, &self.bind, &[]);
                pass.draw(0..3, 0..1);
            }
            queue.submit([encoder.finish()]);
            let _ = device.poll(wgpu::PollType::Poll);
        }

        /// Reads the render target back and writes it as a PNG.
        fn save(
            &self,
            device: &wgpu::Device,
            queue: &wgpu::Queue,
            path: &Path,
        ) -> Result<(), Box<dyn std::error::Error>> {
            let mut encoder = device.create_command_encoder(&Default::default());
            encoder.copy_texture_to_buffer(
                self.target.as_image_copy(),
                wgpu::TexelCopyBufferInfo {
                    buffer: &self.readback,
                    layout: wgpu::TexelCopyBufferLayout {
                        offset: 0,
                        bytes_per_row: Some(SIZE * 4),
                        rows_per_image: Some(SIZE),
                    },
                },
                extent(SIZE),
            );
            queue.submit([encoder.finish()]);
            self.readback
                .map_async(wgpu::MapMode::Read, .., |r| r.expect("readback maps"));
            device.poll(wgpu::PollType::wait_indefinitely())?;
            let pixels = self.readback.get_mapped_range(..)?.to_vec();
            self.readback.unmap();
            let mut png = png::Encoder::new(std::fs::File::create(path)?, SIZE, SIZE);
            png.set_color(png::ColorType::Rgba);
            png.set_depth(png::BitDepth::Eight);
            png.write_header()?.write_image_data(&pixels)?;
            Ok(())
        }
    }

    /// The frames and the tiles' leases as Chrome / Perfetto trace events (one track each).
    fn write_timeline(path: &Path, events: &[Event]) -> std::io::Result<()> {
        let rows: Vec<serde_json::Value> = events
            .iter()
            .map(|(name, track, start, end)| {
                serde_json::json!({
                    "name": name,
                    "ph": "X",
                    "pid": 1,
                    "tid": track,
                    "ts": start.as_micros() as u64,
                    "dur": (end.saturating_sub(*start)).as_micros() as u64,
                })
            })
            .collect();
        std::fs::write(path, serde_json::to_vec_pretty(&rows)?)
    }
}
