//! The shared support's own helpers that need no process (the support
//! library has no test target of its own).

use wasmrelay_test_support::relay::listening_addr;

#[test]
fn listening_addr_reads_each_listener_line() {
    let log = "\
2026-11-30T21:00:00.000000Z  INFO wasmrelay::node: listening listener=\"admin\" addr=127.0.0.1:41234
2026-11-30T21:00:00.000001Z  INFO wasmrelay::node: listening listener=\"client\" addr=127.0.0.1:41235
2026-11-30T21:00:00.000002Z  INFO wasmrelay::node: listening listener=\"mesh\" addr=[::1]:41236 extra=1
";
    assert_eq!(
        listening_addr(log, "admin").as_deref(),
        Some("127.0.0.1:41234")
    );
    assert_eq!(
        listening_addr(log, "client").as_deref(),
        Some("127.0.0.1:41235")
    );
    assert_eq!(listening_addr(log, "mesh").as_deref(), Some("[::1]:41236"));
    assert_eq!(listening_addr(log, "other"), None);
    assert_eq!(listening_addr("", "admin"), None);
}
