import sys

if sys.argv[1:2] == ["control"]:
    from bench.control import main

    raise SystemExit(main(sys.argv[2:]))
if sys.argv[1:2] == ["ray"]:
    from bench.ray import main

    raise SystemExit(main(sys.argv[2:]))
from bench.suite import main

raise SystemExit(main())
