//! `istio-redirect`: the plugin binary (see the library).

#![forbid(unsafe_code)]

use std::process::ExitCode;

fn main() -> ExitCode {
    cni::skel::run(&istio_redirect::IstioRedirect)
}
