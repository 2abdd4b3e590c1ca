from pinfeed_server.cli import main

main()
