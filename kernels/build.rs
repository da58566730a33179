//! Under the `cuda` feature, compiles `cuda/*.cu` to PTX in OUT_DIR with nvcc (from
//! `CUDA_HOME/bin` or PATH), for the compute capability in `CUDA_COMPUTE_CAP` (default 90:
//! H100/H200). Without the feature it does nothing, so CPU builds need no CUDA toolkit.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: [&str; 3] = ["attention", "grouped", "softmax_stats"];

fn main() {
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    for k in KERNELS {
        println!("cargo:rerun-if-changed=cuda/{k}.cu");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let nvcc = std::env::var_os("CUDA_HOME")
        .map(|h| PathBuf::from(h).join("bin/nvcc"))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    for k in KERNELS {
        let status = Command::new(&nvcc)
            .args(["-ptx", "-O3", "-std=c++17", &format!("-arch=sm_{cap}")])
            .arg("-o")
            .arg(out.join(format!("{k}.ptx")))
            .arg(format!("cuda/{k}.cu"))
            .status()
            .unwrap_or_else(|e| panic!("cannot run {}: {e} (set CUDA_HOME)", nvcc.display()));
        assert!(status.success(), "nvcc failed on cuda/{k}.cu");
    }
}
