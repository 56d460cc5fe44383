"""mspretrain.train"""
