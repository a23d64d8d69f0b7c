//! With the `emulator` feature, compiles the Metal kernels as C++ for the Metal emulator
//! (see `metal_emulator` below): the only part of the project that needs a C++ compiler.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(mtp_metal_emulator)");
    if std::env::var_os("CARGO_FEATURE_EMULATOR").is_some() {
        metal_emulator();
    }
}

/// `src/kernels.metal` compiled as C++17 through the Metal shim
/// (`emulator/metal_stdlib`), with the fiber scheduler, into a static library; sets
/// `cfg(mtp_metal_emulator)`. Skipped on macOS (real Metal runs there, and a cross build
/// from Linux has no C++ compiler for it). The C++ compiler is `CXX`, else `c++`.
fn metal_emulator() {
    println!("cargo:rerun-if-env-changed=CXX");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
        return;
    }
    let dir = PathBuf::from("src");
    let emu = dir.join("emulator");
    for f in [
        "kernels.metal",
        "emulator/selftest.metal",
        "emulator/metal_stdlib",
        "emulator/emu.h",
        "emulator/kernels.cpp",
        "emulator/scheduler.cpp",
    ] {
        println!("cargo:rerun-if-changed={}", dir.join(f).display());
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let compile = |what: &str, args: &mut dyn FnMut(&mut Command)| {
        let mut cmd = Command::new(&cxx);
        cmd.args(["-std=c++17", "-Wno-attributes"])
            .arg("-I")
            .arg(&dir)
            .arg("-I")
            .arg(&emu)
            .arg("-I")
            .arg(&out);
        args(&mut cmd);
        match cmd.status() {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("{cxx} failed ({s}) on {what}"),
            Err(e) => panic!("the Metal emulator needs a C++17 compiler: cannot run `{cxx}`: {e} (set CXX)"),
        }
    };
    // The kernel list: every `kernel void NAME(` of the preprocessed sources.
    let mut text = String::new();
    for src in [dir.join("kernels.metal"), emu.join("selftest.metal")] {
        let listed = out.join("kernels.i");
        compile("listing the kernels", &mut |c| {
            c.args(["-x", "c++", "-E", "-P", "-DMTP_EMU_LIST"]).arg(&src).arg("-o").arg(&listed);
        });
        text += &std::fs::read_to_string(&listed).expect("preprocessed kernels");
    }
    let mut list = String::new();
    for part in text.split("MTP_EMU_KERNEL_MARK").skip(1) {
        let name: String = part
            .trim_start()
            .strip_prefix("void")
            .expect("`kernel` followed by `void`")
            .trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        list.push_str(&format!("MTP_EMU_KERNEL({name})\n"));
    }
    std::fs::write(out.join("kernel_list.inc"), list).expect("kernel list");
    let native = std::env::var("HOST").ok() == std::env::var("TARGET").ok();
    let mut objects = Vec::new();
    for src in ["kernels.cpp", "scheduler.cpp"] {
        let obj = out.join(src.replace(".cpp", ".o"));
        compile(src, &mut |c| {
            c.args(["-O2", "-ffp-contract=off", "-fPIC", "-c"]).arg(emu.join(src)).arg("-o").arg(&obj);
            if native {
                c.arg("-march=native"); // fma as an instruction, not a libm call (same result)
            }
        });
        objects.push(obj);
    }
    let lib = out.join("libmtp_metal_emulator.a");
    let _ = std::fs::remove_file(&lib);
    let status = Command::new(std::env::var("AR").unwrap_or_else(|_| "ar".into()))
        .arg("crs")
        .arg(&lib)
        .args(&objects)
        .status()
        .expect("ar");
    assert!(status.success(), "ar failed on the Metal emulator");
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=mtp_metal_emulator");
    println!("cargo:rustc-link-lib=dylib=stdc++");
    println!("cargo:rustc-cfg=mtp_metal_emulator");
}
