//! The runtimes tier: the suite driven by programs nobody here wrote, Go's
//! cnitool and containerd (`ctr run --cni`, and its CRI plugin over gRPC
//! as kubelet drives it). One module per former test file. A containerd
//! daemon runs one at a time (`test_kit::fakes::containerd` holds a lock
//! for each), so the containerd and CRI tests never overlap.

mod cnitool;
mod containerd;
mod cri;
