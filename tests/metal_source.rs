//! What the emulator cannot see in the Metal sources, because a C++ compiler ignores
//! attributes: every kernel binds its buffers as `[[buffer(0)]]`, `[[buffer(1)]]`, .. in
//! parameter order (the order `Arg`s are given in, on Metal and in the emulator), and ends
//! with exactly the two built-ins the emulator passes. Checked on the raw text of every
//! `kernel void` (those inside macros too).

use std::path::PathBuf;

fn source(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("metal/src").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// (kernel name, its parameters) for every `kernel void NAME(...)` in `text`.
fn kernels(text: &str) -> Vec<(String, Vec<String>)> {
    let text = text.replace("\\\n", " ");
    let mut out = Vec::new();
    for part in text.split("kernel void ").skip(1) {
        let open = part.find('(').expect("a parameter list");
        let name = part[..open].trim().to_string();
        let mut depth = 0;
        let mut end = open;
        for (i, c) in part[open..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i;
                        break;
                    }
                }
                _ => {}
            }
        }
        // Split at commas outside brackets and parentheses.
        let (mut params, mut cur, mut depth) = (Vec::new(), String::new(), 0);
        for c in part[open + 1..end].chars() {
            match c {
                '(' | '[' => depth += 1,
                ')' | ']' => depth -= 1,
                ',' if depth == 0 => {
                    params.push(cur.split_whitespace().collect::<Vec<_>>().join(" "));
                    cur.clear();
                    continue;
                }
                _ => {}
            }
            cur.push(c);
        }
        params.push(cur.split_whitespace().collect::<Vec<_>>().join(" "));
        out.push((name, params));
    }
    out
}

/// What is wrong with one kernel's parameters, if anything.
fn check(name: &str, params: &[String]) -> Result<(), String> {
    let n = params.len();
    if n < 2
        || !(params[n - 2].starts_with("uint2 ")
            && params[n - 2].ends_with("[[threadgroup_position_in_grid]]"))
        || !(params[n - 1].starts_with("uint ") && params[n - 1].ends_with("[[thread_index_in_threadgroup]]"))
    {
        return Err(format!("{name}: must end with `uint2 .. [[threadgroup_position_in_grid]], uint .. [[thread_index_in_threadgroup]]`"));
    }
    for (i, p) in params[..n - 2].iter().enumerate() {
        if !p.ends_with(&format!("[[buffer({i})]]")) {
            return Err(format!("{name}: parameter {i} `{p}` must be bound as [[buffer({i})]]"));
        }
        let decl = p.split("[[").next().unwrap();
        if !(decl.contains('*') || decl.contains('&')) {
            return Err(format!(
                "{name}: parameter {i} `{p}` is by value (buffers are pointers, constants references)"
            ));
        }
        if !(decl.starts_with("device ") || decl.starts_with("constant ")) {
            return Err(format!("{name}: parameter {i} `{p}` has no device or constant address space"));
        }
    }
    Ok(())
}

#[test]
fn every_kernel_binds_buffers_in_order_and_ends_with_its_builtins() {
    let mut count = 0;
    for file in ["kernels.metal", "emulator/selftest.metal"] {
        for (name, params) in kernels(&source(file)) {
            check(&name, &params).unwrap_or_else(|e| panic!("{file}: {e}"));
            count += 1;
        }
    }
    // The linear, embedding, attention and K/V macros each count once.
    assert!(count >= 25, "only {count} kernels found: the parser missed some");
}

/// Negative control: the check catches a skipped index, a missing built-in, a by-value
/// parameter and a missing address space.
#[test]
fn the_check_rejects_misnumbered_kernels() {
    let bad = [
        "kernel void a(device float* x [[buffer(0)]], device float* y [[buffer(2)]], uint2 g [[threadgroup_position_in_grid]], uint t [[thread_index_in_threadgroup]]) {}",
        "kernel void b(device float* x [[buffer(0)]], uint t [[thread_index_in_threadgroup]]) {}",
        "kernel void c(int n [[buffer(0)]], uint2 g [[threadgroup_position_in_grid]], uint t [[thread_index_in_threadgroup]]) {}",
        "kernel void d(float* x [[buffer(0)]], uint2 g [[threadgroup_position_in_grid]], uint t [[thread_index_in_threadgroup]]) {}",
    ];
    for text in bad {
        let (name, params) = kernels(text).pop().unwrap();
        assert!(check(&name, &params).is_err(), "{text}");
    }
    let good = "kernel void e(device float* x [[buffer(0)]], constant int& n [[buffer(1)]], uint2 g [[threadgroup_position_in_grid]], uint t [[thread_index_in_threadgroup]]) {}";
    let (name, params) = kernels(good).pop().unwrap();
    assert_eq!(check(&name, &params), Ok(()));
}
