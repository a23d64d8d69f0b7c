//! Which SIMD path this machine's CPU kernels take (the base crate's dequantization and the
//! kernels crate's dot products ask the same question). Every path computes the same bits;
//! the choice only changes speed.

/// Which SIMD path this machine takes; chosen once, the same for every call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
    Portable,
}

pub fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // What the AVX-512 paths are compiled with (every AVX-512 CPU since Skylake-SP
            // has the three; VL lets 256- and 128-bit operations use all 32 registers).
            if std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
            {
                return Isa::Avx512;
            }
            if std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
            {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    })
}
