//! Guest programs for the VMM's tests: the shared fixture of `agentenv-testkit`
//! (`agentenv_testkit::vmm`), under the name these tests know it by.
#![allow(unused_imports)]

pub use agentenv_testkit::vmm::*;
