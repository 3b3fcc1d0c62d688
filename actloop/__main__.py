from actloop.cli import main

main()
