"""mspretrain.eval"""
