from planetserve.cli import main

main()
