"""mspretrain.checkpoint"""
