//! A result as another plugin prints it: JSON that is not a result is
//! error 6; a result prints in every version it fits, and what it prints
//! reads back and prints identically.
#![no_main]
use cni::result::CniResult;
use cni::version::Version;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(doc) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let result = match CniResult::from_value(&doc) {
        Ok(result) => result,
        Err(e) => {
            assert_eq!(e.code, 6, "{e:?}");
            return;
        }
    };
    for version in Version::ALL {
        let Ok(printed) = result.to_value(version) else {
            continue;
        };
        let read = CniResult::from_value(&printed).expect("a printed result reads back");
        let again = read.to_value(version).expect("prints again");
        assert_eq!(again, printed, "{version:?} is not a fixed point");
    }
});
