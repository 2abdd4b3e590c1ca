import sys

if sys.argv[1:2] == ["control"]:
    from bench.control import main

    raise SystemExit(main(sys.argv[2:]))
if sys.argv[1:2] == ["autotune"]:
    from bench.autotune import main as autotune

    raise SystemExit(autotune(sys.argv[2:]))
if sys.argv[1:2] == ["w4-profile"]:
    from bench.profile_w4 import main

    raise SystemExit(main(sys.argv[2:]))
if sys.argv[1:2] == ["scale"]:
    from bench.scale import main

    raise SystemExit(main(sys.argv[2:]))
if sys.argv[1:2] == ["ray"]:
    from bench.ray import main

    raise SystemExit(main(sys.argv[2:]))
if sys.argv[1:2] and sys.argv[1].upper() == "W9":
    from bench.w9 import main as w9

    raise SystemExit(w9(sys.argv[2:]))
from bench.suite import main

if sys.argv[1:2] and sys.argv[1].upper() in ("W1", "W2", "W3", "W4", "W5"):
    # One workload alone, without the scaling section: python -m bench w4 [--runs ...]
    raise SystemExit(main(["--workloads", sys.argv[1], "--trainers", "", *sys.argv[2:]]))
raise SystemExit(main())
