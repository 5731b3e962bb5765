from .train.command import main

main()
