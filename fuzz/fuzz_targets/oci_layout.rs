#![no_main]
//! See `strata_builder::fuzzing::oci_layout`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| strata_builder::fuzzing::oci_layout(data));
