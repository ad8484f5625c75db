//! Sets `cfg(leasehold_console)` for this crate's targets. The render_farm and frame_loop demos
//! are files of the root package that this crate builds again as its own examples
//! (`render_farm_console`, `frame_loop_console`); under this cfg they serve the web console, and
//! render_farm runs its GPU jobs (this crate's dev-dependency on leasehold has the `gpu`
//! feature, which the demo, written for the root package, checks as `feature = "gpu"`).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(leasehold_console)");
    println!("cargo::rustc-cfg=leasehold_console");
    println!("cargo::rustc-check-cfg=cfg(feature, values(\"gpu\"))");
}
