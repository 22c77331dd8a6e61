//! A network configuration as a runtime writes it on stdin: anything that
//! is not a configuration is error 1, 6 or 7, never a panic, and what the
//! plugins read next (prevResult, GC's attachment list) fails as cleanly.
#![no_main]
use cni::conf::{self, NetConf};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let outcome = conf::parse_document(data)
        .and_then(NetConf::read)
        .and_then(|conf| conf.prev_result().and(conf.gc_valid_attachments()));
    if let Err(e) = outcome {
        assert!(matches!(e.code, 1 | 6 | 7), "{e:?}");
    }
});
