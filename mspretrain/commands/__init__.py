"""Command adapters: argparse in, library calls out. Library modules never import these."""
