//! CNI_ARGS as a runtime passes it: anything is parsed or refused (error
//! 4), never a panic, and what parses prints back to the same pairs.
#![no_main]
use cni::args::CniArgs;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match CniArgs::parse(text) {
        Ok(args) => {
            let printed: Vec<String> = args.pairs().iter().map(|(k, v)| format!("{k}={v}")).collect();
            let again = CniArgs::parse(&printed.join(";")).expect("printed pairs parse");
            assert_eq!(again.pairs(), args.pairs());
        }
        Err(e) => assert_eq!(e.code, 4, "{e:?}"),
    }
});
